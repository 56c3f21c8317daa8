"""What the installed plugin costs a torch-free project: pytest runs of a one-test project
with the plugin (loaded, as in every project of an environment where it is installed) against
``-p no:vram`` (as if it were not installed). Separate processes, since startup is the cost;
the two variants alternate in each round and each round starts with the other one. Prints the
median time of each and the median of the per-round ratios:

    python benchmarks/bench_startup.py [--rounds 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TEST_FILE = """
def test_arithmetic():
    assert sum(range(10)) == 45
"""

VARIANTS = {
    "plugin installed and loaded": [],
    "-p no:vram (as if not installed)": ["-p", "no:vram"],
}


def run_once(directory: Path, extra: list[str]) -> float:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra]
    start = time.perf_counter()
    subprocess.run(command, cwd=directory, check=True, capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        (directory / "test_plain.py").write_text(TEST_FILE)
        names = list(VARIANTS)
        times: dict[str, list[float]] = {name: [] for name in names}
        run_once(directory, [])  # warm the file cache
        for round_index in range(args.rounds):
            order = names if round_index % 2 == 0 else names[::-1]
            for name in order:
                times[name].append(run_once(directory, VARIANTS[name]))
    base = times[names[1]]
    print(f"a one-test torch-free project, {args.rounds} rounds of pytest runs:")
    for name in names:
        ratios = [t / b for t, b in zip(times[name], base, strict=True)]
        print(
            f"  {name:36} median {statistics.median(times[name]):.3f} s  "
            f"ratio {statistics.median(ratios):.3f}x"
        )


if __name__ == "__main__":
    main()
