"""A model whose builder reads values, shape-only: the 24-layer, d_model 1024 LM of
``tests/test_sim_parity.py`` (``trunc_normal_`` at three standard deviations), one training step
of 8 x 128 tokens, built inside the simulated device or on the host and moved to it.

    python benchmarks/bench_sim_builder.py device|host
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import test_sim_parity as parity


def main(where: str) -> None:
    config = {"width": 1024, "layers": 24, "heads": 16}
    host = parity.LM(**config) if where == "host" else None
    start = time.perf_counter()
    with parity.simulated(False) as backend:
        parity.lm_step(**config)(host)
        peak = backend.peak_allocated()
    print(f"{where}: shape-only peak {peak:,} B in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "device")
