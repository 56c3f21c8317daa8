"""Per-test ratios of the simulated device's peaks to the real GPU's, from two --vram-json files.

python scripts/sim_vs_cuda.py SIM.json CUDA.json
"""

from __future__ import annotations

import json
import sys

from pytest_vram.units import format_size


def peaks(path: str) -> dict[str, dict]:
    with open(path, encoding="utf-8") as handle:
        return {test["nodeid"]: test for test in json.load(handle)["tests"]}


def main(sim_path: str, cuda_path: str) -> int:
    sim, cuda = peaks(sim_path), peaks(cuda_path)
    common = sorted(set(sim) & set(cuda))
    print(f"{'test':<70} {'metric':<10} {'sim':>12} {'cuda':>12} {'sim/cuda':>9}")
    worst = 0.0
    for nodeid in common:
        for metric in ("peak_allocated", "peak_reserved"):
            real, simulated = cuda[nodeid].get(metric), sim[nodeid].get(metric)
            if not real or simulated is None:
                continue
            ratio = simulated / real
            if metric == "peak_allocated":
                worst = max(worst, abs(ratio - 1))
            print(
                f"{nodeid:<70} {metric[5:]:<10} {format_size(simulated):>12} "
                f"{format_size(real):>12} {ratio:9.4f}"
            )
    print(f"{len(common)} tests on both; largest allocated deviation {worst:.2%}")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
