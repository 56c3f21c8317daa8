"""Overhead of ``--vram-report`` on 1000 small torch tests (cpu backend) against plain pytest.

Runs both in one invocation, alternating, and prints the median session times and their ratio:

    python benchmarks/bench_overhead.py [--tests 1000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEST_FILE = """
import pytest
import torch

@pytest.mark.parametrize("n", range({count}))
def test_small(n):
    x = torch.ones(64) * n
    assert x.sum().item() == 64 * n
"""

VARIANTS = {
    "plain pytest (-p no:vram)": ["-p", "no:vram"],
    "plugin loaded, nothing measured": [],
    "--vram-report --vram-backend=cpu": ["--vram-report", "--vram-backend=cpu"],
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
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        (root / "test_many.py").write_text(TEST_FILE.format(count=args.tests))
        (root / "pytest.ini").write_text("[pytest]\n")
        # Import torch before the session starts in every variant (the plugin imports it at
        # start-up), so that session times compare the tests, not torch's import.
        (root / "conftest.py").write_text("import torch  # noqa: F401\n")
        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        walls: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, extra in VARIANTS.items():
                started = time.perf_counter()
                done = subprocess.run(
                    [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra],
                    cwd=root,
                    capture_output=True,
                    text=True,
                    check=False,
                )
                walls[name].append(time.perf_counter() - started)
                times[name].append(session_seconds(done.stdout))
    plain = statistics.median(times["plain pytest (-p no:vram)"])
    print(f"{args.tests} tests, median of {args.rounds} rounds (session time; wall time)")
    for name in VARIANTS:
        session = statistics.median(times[name])
        wall = statistics.median(walls[name])
        print(f"  {name:<36} {session:6.2f} s  {wall:6.2f} s  ratio {session / plain:.3f}x")


if __name__ == "__main__":
    main()
