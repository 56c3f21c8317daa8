"""Load, compare and write a baseline file of 10,000 entries; prints the time of each. With
``--large N``, also writes a file of N entries with the dumper and loads it in a fresh process,
printing the load's time and its peak memory (the rise of the process's peak RSS).

python benchmarks/bench_baselines.py [--entries 10000] [--rounds 5] [--large 2000000]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pytest_vram.baselines.compare import compare_with_entry
from pytest_vram.baselines.file import BaselineFile, read_careful, read_fast
from pytest_vram.units import parse_tolerance

# Run in a fresh interpreter, so that its peak RSS is the load's and nothing else's. Linux's
# VmHWM, not getrusage: a child's ru_maxrss starts from its parent's, which built the file.
LOAD_ONE = """
import json, sys, time
from pathlib import Path
from pytest_vram.baselines.file import BaselineFile

def peak_bytes():
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024

before = peak_bytes()
wall, cpu = time.perf_counter(), time.process_time()
loaded = BaselineFile.read(Path(sys.argv[1]))
wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
print(json.dumps({"entries": len(loaded.entries), "wall": wall, "cpu": cpu,
                  "rss_before": before, "rss_peak": peak_bytes()}))
"""


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


def small(entries: int, rounds: int) -> None:
    tolerance = parse_tolerance("5%")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "nvidia-h100-80gb-hbm3.yaml"
        baseline = make_file(path, entries)
        write_s, _ = timed(baseline.write, rounds)
        load_s, loaded = timed(lambda: BaselineFile.read(path), rounds)
        fast_s, fast = timed(lambda: read_fast(path), rounds)
        careful_s, careful = timed(lambda: read_careful(path), rounds)
        assert fast == careful == loaded
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

        compare_s, _ = timed(compare_all, rounds)
        size = path.stat().st_size
    print(f"{entries} entries, {size / 1024:.0f} KiB file, median of {rounds} rounds")
    print(f"  write   {write_s * 1000:8.1f} ms")
    print(f"  load    {load_s * 1000:8.1f} ms")
    print(f"    the fast reader alone     {fast_s * 1000:8.1f} ms")
    print(f"    the careful YAML reader   {careful_s * 1000:8.1f} ms")
    print(f"  compare {compare_s * 1000:8.1f} ms")


def large(entries: int) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "nvidia-h100-80gb-hbm3.yaml"
        baseline = make_file(path, entries)
        started = time.perf_counter()
        baseline.write()
        write_s = time.perf_counter() - started
        del baseline
        size = path.stat().st_size
        done = subprocess.run(
            [sys.executable, "-c", LOAD_ONE, str(path)],
            check=True,
            capture_output=True,
            text=True,
        )
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["entries"] == entries, result
    rise = result["rss_peak"] - result["rss_before"]
    print(f"{entries} entries, {size / 1024**2:.0f} MiB file written by the dumper")
    print(f"  write   {write_s:6.1f} s")
    print(f"  load    {result['wall']:6.1f} s ({result['cpu']:.1f} s of CPU)")
    print(f"  peak RSS rise while loading {rise / 1024**2:6.0f} MiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--large", type=int, default=0, help="also load a file of this many")
    args = parser.parse_args()
    small(args.entries, args.rounds)
    if args.large:
        large(args.large)


if __name__ == "__main__":
    main()
