"""How long the project's own test runs take: ``pytest tests`` (the default set, which skips
the tests marked slow) and ``pytest suites --vram-report`` (the example suites, measured), each
in a process of its own from the repository root. Prints the wall time of each run, with the
line pytest ended it with, and the median where there are several rounds:

    python benchmarks/bench_test_suite.py [--rounds 1] [--run-slow]

``--run-slow`` times ``pytest tests --run-slow`` too, the whole set that CI runs.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(args: list[str]) -> tuple[float, int, str]:
    """The wall time, exit status and last output line of one ``python -m pytest`` run."""
    command = [sys.executable, "-m", "pytest", "-q", *args]
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    elapsed = time.perf_counter() - start
    lines = (done.stdout + done.stderr).strip().splitlines() or ["(no output)"]
    return elapsed, done.returncode, lines[-1].strip("= ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--run-slow", action="store_true", help="also time pytest tests --run-slow")
    args = parser.parse_args()
    variants = {
        "pytest tests": ["tests"],
        "pytest suites --vram-report": ["suites", "--vram-report"],
    }
    if args.run_slow:
        variants["pytest tests --run-slow"] = ["tests", "--run-slow"]
    failed = False
    for name, extra in variants.items():
        times = []
        for _ in range(args.rounds):
            elapsed, status, summary = run_once(extra)
            times.append(elapsed)
            failed |= status != 0
            print(f"{name:30} {elapsed:7.1f} s  exit {status}  {summary}", flush=True)
        if args.rounds > 1:
            print(f"{name:30} median {statistics.median(times):.1f} s over {args.rounds} rounds")
    if failed:
        sys.exit("some runs failed: their times are not those of a passing run")


if __name__ == "__main__":
    main()
