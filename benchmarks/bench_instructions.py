"""Instructions per small test, counted by valgrind's callgrind: the plugin's cost without the
machine's noise.

Wall times on a shared machine move by more than the plugin costs a small test. The number of
instructions a session executes does not: this runs each variant's session twice under
callgrind, with ``--small`` and ``--large`` tests (the ones ``bench_overhead.py`` uses, every
one measured on the cpu backend), and divides the difference by the difference in tests. The
start (importing torch, collecting) cancels out; what is left is one test's share, the
garbage collections its objects bring about included. Variants: plain pytest (``-p no:vram``),
``--vram-report --vram-backend=cpu``, the same with ``--vram-seed=off`` (what seeding the
random generators costs), and with ``--against DIR`` the same with the ``pytest_vram``
package of another checkout first on ``sys.path`` (``git worktree add DIR COMMIT``).

    python benchmarks/bench_instructions.py [--small 300] [--large 1300] [--against DIR]

Needs ``valgrind``; takes a few minutes per variant (callgrind runs Python about 50 times
slower), two sessions at a time on a machine with two cores.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from small_tests import TEST_FILE

MEASURED = ["--vram-report", "--vram-backend=cpu"]


def instructions(folder: Path, args: list[str], env: dict[str, str]) -> int:
    """The instructions one pytest session in ``folder`` executes."""
    handle, name = tempfile.mkstemp(prefix="callgrind.", dir=folder)
    os.close(handle)
    out = Path(name)
    subprocess.run(
        [
            "valgrind",
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:randomly",
            *args,
        ],
        cwd=folder,
        capture_output=True,
        check=True,
        # One thread, and one hash seed: the same instructions on every run.
        env={**os.environ, **env, "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0"},
    )
    found = re.search(r"^summary:\s*(\d+)", out.read_text(), re.MULTILINE)
    out.unlink()
    assert found is not None, "callgrind wrote no summary"
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", type=int, default=300)
    parser.add_argument("--large", type=int, default=1300)
    parser.add_argument("--against", type=Path, help="a checkout of another version")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("bench_instructions.py needs valgrind (apt-get install valgrind)")
    variants: dict[str, tuple[list[str], dict[str, str]]] = {
        "plain pytest (-p no:vram)": (["-p", "no:vram"], {}),
        "--vram-report --vram-backend=cpu": (MEASURED, {}),
        "  the same, --vram-seed=off": ([*MEASURED, "--vram-seed=off"], {}),
    }
    if args.against is not None:
        variants[f"  the same, pytest_vram of {args.against}"] = (
            MEASURED,
            {"PYTHONPATH": str(args.against.resolve())},
        )
    with tempfile.TemporaryDirectory() as temp:
        folders = {}
        for count in (args.small, args.large):
            folder = folders[count] = Path(temp) / f"tests{count}"
            folder.mkdir()
            (folder / "test_small.py").write_text(TEST_FILE.format(count=count))
            (folder / "pytest.ini").write_text("[pytest]\n")
            # Compiled once, so that no session pays for writing the bytecode.
            subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:vram"],
                cwd=folder,
                capture_output=True,
            )
        jobs = [(name, count) for name in variants for count in (args.small, args.large)]
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            figures = pool.map(lambda job: instructions(folders[job[1]], *variants[job[0]]), jobs)
            counted = dict(zip(jobs, figures, strict=True))
    tests = args.large - args.small
    per_test = {
        name: (counted[name, args.large] - counted[name, args.small]) / tests for name in variants
    }
    plain = per_test["plain pytest (-p no:vram)"]
    print(f"instructions per test, from sessions of {args.small} and {args.large} tests")
    for name, figure in per_test.items():
        print(
            f"  {name:<44} {figure / 1e3:8.1f} k  extra {(figure - plain) / 1e3:6.1f} k"
            f"  ratio {figure / plain:.3f}x"
        )


if __name__ == "__main__":
    main()
