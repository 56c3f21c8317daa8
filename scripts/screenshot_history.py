"""Write a synthetic history of main, render it with ``pytest-vram history`` and take a
screenshot of the page in headless Chromium.

    python scripts/screenshot_history.py [--output docs/history-page.png] [--html history.html]

The history: 40 commits of six tests, one --vram-json document per commit as the plugin writes
it; a training step that steps up twice (a checkpointing flag turned off, then a larger batch),
a forward that steps up once and back down, a test added halfway, and tests that only wobble.
It makes the picture in docs/ci.md and lets a test check that the page renders in a browser.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pytest_vram.record.record import TestRecord
from pytest_vram.report.document import build_document

MiB = 1024**2
ROOT = Path(__file__).resolve().parent.parent
START = datetime.datetime(2026, 10, 1, 9, tzinfo=datetime.timezone.utc)
COMMITS = 40

#: Each test's peak at each commit: (first commit it runs, base peak, {commit: new peak}).
TESTS: dict[str, tuple[int, int, dict[int, int]]] = {
    "tests/test_train.py::test_training_step_fits_its_budget": (
        0,
        130 * MiB,
        {14: 154 * MiB, 31: 201 * MiB},
    ),
    "tests/test_model.py::test_forward[bf16]": (0, 64 * MiB, {22: 96 * MiB, 27: 64 * MiB}),
    "tests/test_model.py::test_forward[fp32]": (0, 128 * MiB, {}),
    "tests/test_generate.py::test_kv_cache[4096]": (0, 300 * MiB, {}),
    "tests/test_data.py::test_collate": (0, 12 * MiB, {}),
    "tests/test_lora.py::test_adapter_step": (20, 40 * MiB, {}),
}


def write_history(directory: Path) -> list[str]:
    """One document per commit in ``directory``; the commit names, oldest first."""
    directory.mkdir(parents=True, exist_ok=True)
    names = []
    peaks = {name: base for name, (_, base, _) in TESTS.items()}
    for commit in range(COMMITS):
        sha = hashlib.sha1(f"commit {commit}".encode()).hexdigest()
        names.append(sha)
        records = []
        for name, (first, _, changes) in TESTS.items():
            if commit < first:
                continue
            peaks[name] = changes.get(commit, peaks[name])
            # Up to 256 KiB of wobble from commit to commit, well within any tolerance.
            wobble = (hashlib.sha1(f"{name}{commit}".encode()).digest()[0] - 128) * 2048
            records.append(
                TestRecord(
                    nodeid=name,
                    backend="sim",
                    device="sim",
                    peak_allocated=peaks[name] + wobble,
                    status="ok",
                )
            )
        run = {
            "measured": "marked",
            "commit": sha,
            "commit_date": (START + datetime.timedelta(hours=7 * commit)).isoformat(),
        }
        document = build_document(records, {"sim": {"backend": "sim", "device": "sim"}}, run)
        (directory / f"{sha}.json").write_text(json.dumps(document, indent=2) + "\n")
    return names


def _screenshot_module():
    spec = importlib.util.spec_from_file_location(
        "screenshot_html", ROOT / "scripts" / "screenshot_html.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="docs/history-page.png", help="the PNG to write")
    parser.add_argument("--html", help="also keep the rendered page here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="pytest-vram-history-") as tmp:
        documents = Path(tmp) / "documents"
        write_history(documents)
        page = Path(args.html) if args.html else Path(tmp) / "history.html"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest_vram.cli",
                "history",
                str(documents),
                "--html",
                str(page),
            ],
            check=True,
        )
        _screenshot_module().screenshot(page, args.output, window="1200,1500")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
