"""The GPU check's snapshot stage: a failing test's memory snapshot, read back and rendered.

    python scripts/gpu_check_snapshot.py --backend cuda --workdir DIR --out OUT

Runs a measured test that fails under ``--vram-snapshot-on-fail``, loads the snapshot the
plugin wrote with an unpickler that refuses every global (a snapshot is plain data: dicts,
lists, strings and numbers), checks that it holds the test's allocations, and renders it with
``torch.cuda._memory_viz.trace_plot``. Copies the pickle to OUT/snapshot.pickle and writes
OUT/memory-viz.html. Exit status 1 when a step fails, with a message naming the file.
"""

from __future__ import annotations

import argparse
import io
import pickle
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

MiB = 1024 * 1024

# Four float32 blocks of 4, 8, 12 and 16 MiB, the second freed: three stay live in the trace.
TEST = f"""
import torch


def test_fails_with_a_snapshot(vram):
    blocks = [torch.ones({MiB} * (i + 1), device=vram.device) for i in range(4)]
    del blocks[1]
    assert False, "fails on purpose: the GPU check reads its snapshot"
"""
SMALLEST_BLOCK = 4 * MiB


class SnapshotError(Exception):
    """A snapshot that cannot be read back: the message names the file."""


class DataOnlyUnpickler(pickle.Unpickler):
    """Loads plain data and refuses every global, so a snapshot cannot run code when read."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"refused the global {module}.{name}: only plain data loads")

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"refused the persistent id {pid!r:.60}")


def loads(data: bytes) -> Any:
    """Unpickle ``data`` with no globals allowed."""
    return DataOnlyUnpickler(io.BytesIO(data)).load()


def load_snapshot(path: Path) -> dict[str, Any]:
    """A memory snapshot from ``path``: a dict with ``segments`` and ``device_traces``."""
    try:
        snapshot = loads(path.read_bytes())
    except OSError as exc:
        raise SnapshotError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError) as exc:
        raise SnapshotError(f"{path}: not a plain-data pickle: {exc}") from None
    if not isinstance(snapshot, dict):
        raise SnapshotError(f"{path}: a {type(snapshot).__name__}, not a snapshot dict")
    for key in ("segments", "device_traces"):
        if not isinstance(snapshot.get(key), list):
            raise SnapshotError(f"{path}: no {key!r} list: not a PyTorch memory snapshot")
    return snapshot


def allocations(snapshot: dict[str, Any]) -> list[int]:
    """The sizes of the trace's ``alloc`` events, on every device."""
    return [
        event.get("size", 0)
        for trace in snapshot["device_traces"]
        for event in trace
        if isinstance(event, dict) and event.get("action") == "alloc"
    ]


def run_failing_test(backend: str, workdir: Path) -> Path:
    """Run the failing test; the one snapshot it left."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "test_snapshot.py").write_text(TEST, encoding="utf-8")
    command = [
        sys.executable, "-m", "pytest", "test_snapshot.py", "-q", "-p", "no:cacheprovider",
        "-p", "no:randomly", f"--vram-backend={backend}", "--vram-snapshot-on-fail=snapshots",
    ]  # fmt: skip
    print("$", " ".join(command[2:]))
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, check=False)
    print(done.stdout.rstrip().splitlines()[-1] if done.stdout.strip() else done.stderr)
    if done.returncode != 1:  # 1: tests failed, as this one must
        print(done.stdout + done.stderr)
        raise SnapshotError(f"{workdir / 'test_snapshot.py'}: pytest exited {done.returncode}")
    found = sorted((workdir / "snapshots").glob("*.pickle"))
    if len(found) != 1:
        raise SnapshotError(f"{workdir / 'snapshots'}: {len(found)} snapshots, expected one")
    return found[0]


def render(snapshot: dict[str, Any]) -> str:
    """The snapshot's memory timeline as a page, as ``python -m torch.cuda._memory_viz`` does."""
    from torch.cuda._memory_viz import trace_plot

    return trace_plot(snapshot)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        path = run_failing_test(args.backend, args.workdir)
        snapshot = load_snapshot(path)
        sizes = allocations(snapshot)
        if sum(size >= SMALLEST_BLOCK for size in sizes) < 4:
            raise SnapshotError(f"{path}: {len(sizes)} allocations, not the test's four blocks")
        print(
            f"{path.name}: {path.stat().st_size} bytes, loaded with no globals; "
            f"{len(snapshot['segments'])} segments, {len(sizes)} allocations in the trace"
        )
        try:
            page = render(snapshot)
        except Exception as exc:  # torch's viewer is private API: any failure is the stage's
            raise SnapshotError(f"{path}: torch.cuda._memory_viz cannot render it: {exc}") from None
    except SnapshotError as exc:
        print(f"snapshot: {exc}", file=sys.stderr)
        return 1
    args.out.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(path, args.out / "snapshot.pickle")
    (args.out / "memory-viz.html").write_text(page, encoding="utf-8")
    print(
        f"rendered with torch.cuda._memory_viz.trace_plot: memory-viz.html, {len(page)} "
        "characters; the pickle as snapshot.pickle"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
