"""Load, compare and write a baseline file of 10,000 entries; prints the time of each.

python benchmarks/bench_baselines.py [--entries 10000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from pytest_vram.baselines import BaselineFile, compare_with_entry
from pytest_vram.units import parse_tolerance


def make_file(path: Path, entries: int) -> BaselineFile:
    baseline = BaselineFile(path, "NVIDIA H100 80GB HBM3", {"torch": "2.13.0", "cuda": "12.8"})
    for index in range(entries):
        nodeid = f"tests/test_module_{index // 100:03d}.py::test_case[{index}]"
        baseline.entries[nodeid] = {
            "peak_allocated": 1_000_000 + index * 512,
            "peak_reserved": 2_097_152 * (1 + index % 7),
            "single_step_peak": 900_000 + index * 512,
            "idle": 500_000,
        }
    return baseline


def timed(fn, rounds: int) -> tuple[float, object]:
    times, result = [], None
    for _ in range(rounds):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tolerance = parse_tolerance("5%")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "nvidia-h100-80gb-hbm3.yaml"
        baseline = make_file(path, args.entries)
        write_s, _ = timed(baseline.write, args.rounds)
        load_s, loaded = timed(lambda: BaselineFile.read(path), args.rounds)
        current = {
            nodeid: {**figures, "peak_allocated": figures["peak_allocated"] + 4096}
            for nodeid, figures in loaded.entries.items()
        }

        def compare_all() -> int:
            return sum(
                any(
                    change.regressed
                    for change in compare_with_entry(current[nodeid], figures, tolerance)
                )
                for nodeid, figures in loaded.entries.items()
            )

        compare_s, _ = timed(compare_all, args.rounds)
        size = path.stat().st_size
    print(f"{args.entries} entries, {size / 1024:.0f} KiB file, median of {args.rounds} rounds")
    print(f"  write   {write_s * 1000:8.1f} ms")
    print(f"  load    {load_s * 1000:8.1f} ms")
    print(f"  compare {compare_s * 1000:8.1f} ms")


if __name__ == "__main__":
    main()
