"""Overhead of ``--vram-report`` on 1000 small torch tests (cpu backend) against plain pytest.

Runs every variant in one invocation, alternating them in each round (each round starting with
another one), and prints the median session times, the median of the per-round ratios to plain
pytest, and the ratio of the medians:

    python benchmarks/bench_overhead.py [--tests 1000] [--rounds 20]

The cpu backend counts inside PyTorch's CPU allocator by default; one variant runs it with the
dispatch counter (a ``TorchDispatchMode`` that sees every op) instead, and one pushes a
pass-through ``TorchDispatchMode`` for the whole session without the plugin: what PyTorch charges
for handing every op to Python, the floor under the dispatch counter.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from small_tests import PASS_THROUGH_MODE, TEST_FUNCTION

TEST_FILE = (
    """
import pytest
import torch

@pytest.mark.parametrize("n", range({count}))"""
    + TEST_FUNCTION
)

# Import torch before the session starts in every variant (the plugin imports it at start-up),
# so that session times compare the tests, not torch's import.
CONFTEST = (
    """
import os

import torch
"""
    + PASS_THROUGH_MODE
    + """

def pytest_sessionstart(session):
    if os.environ.get("BENCH_PASS_THROUGH_MODE"):
        PassThrough().__enter__()
"""
)

PLAIN = "plain pytest (-p no:vram)"
VARIANTS: dict[str, tuple[list[str], dict[str, str]]] = {
    PLAIN: (["-p", "no:vram"], {}),
    "plugin loaded, nothing measured": ([], {}),
    "pass-through dispatch mode, no plugin": (["-p", "no:vram"], {"BENCH_PASS_THROUGH_MODE": "1"}),
    "--vram-report --vram-backend=cpu": (["--vram-report", "--vram-backend=cpu"], {}),
    "  the same, --vram-cpu-counter=dispatch": (
        ["--vram-report", "--vram-backend=cpu", "--vram-cpu-counter=dispatch"],
        {},
    ),
}


def session_seconds(output: str) -> float:
    """pytest's own 'N passed in X.XXs': the session, without interpreter start-up."""
    match = re.search(r"passed in ([0-9.]+)s", output)
    if match is None:
        raise RuntimeError(f"no pytest summary in:\n{output[-2000:]}")
    return float(match.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tests", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "test_many.py").write_text(TEST_FILE.format(count=args.tests))
        (root / "pytest.ini").write_text("[pytest]\n")
        (root / "conftest.py").write_text(CONFTEST)
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        walls: dict[str, list[float]] = {name: [] for name in VARIANTS}
        names = list(VARIANTS)
        for round_ in range(args.rounds):
            # Each round starts with another variant: the first run after a pause is slower.
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                extra, env = VARIANTS[name]
                started = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra],
                    cwd=root,
                    capture_output=True,
                    text=True,
                    check=False,
                    env={**os.environ, **env},
                )
                walls[name].append(time.perf_counter() - started)
                times[name].append(session_seconds(done.stdout))
    print(f"{args.tests} tests, {args.rounds} rounds: median session and wall time; the median")
    print("of the per-round ratios to plain pytest, and the ratio of the median session times")
    for name in VARIANTS:
        # The machine's speed drifts between rounds; a ratio within one round does not.
        ratio = statistics.median(a / b for a, b in zip(times[name], times[PLAIN], strict=True))
        session = statistics.median(times[name])
        wall = statistics.median(walls[name])
        of_medians = session / statistics.median(times[PLAIN])
        print(
            f"  {name:<40} {session:6.2f} s  {wall:6.2f} s  "
            f"ratio {ratio:.3f}x  of medians {of_medians:.3f}x"
        )


if __name__ == "__main__":
    main()
