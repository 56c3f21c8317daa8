"""What simulating a 32B-parameter training step costs: sim backend against plain FakeTensorMode
and against PyTorch's MemTracker, measured in one run.

The step: the repository's GPT at the Qwen2.5-32B shape (32,763,876,352 parameters), bf16
weights, one 512-token sequence, forward, backward and an AdamW step (foreach, as on CUDA), two
steps from a fresh optimizer (the first creates AdamW's moments). Three ways to run it:

- plain: under ``FakeTensorMode`` alone, which computes nothing and counts nothing: the floor;
- sim: on the sim backend (``FakeTensorMode`` plus the storage count, the segment model and the
  virtual CUDA device), written for CUDA (``device="cuda"``);
- MemTracker: ``torch.distributed._tools.mem_tracker.MemTracker`` under ``FakeTensorMode``.

Plain and sim alternate for ``--rounds`` rounds after a warm-up round each, so that both see the
same machine: on a shared machine the speed drifts by tens of percent between minutes, and the
ratio within a round (the median over rounds is reported) drifts far less than either time.
MemTracker, far slower, runs once and is compared with sim's median. The peaks of sim and
MemTracker are compared too. Run from the repository root:

    python benchmarks/bench_sim.py [--rounds 7] [--json results.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "suites"))

from gpt import GPT, GPTConfig, default_dtype, training_step  # noqa: E402

from pytest_vram.backends.sim.backend import SimBackend  # noqa: E402

CONFIG = GPTConfig.qwen2_5_32b()
SEQ = 512
STEPS = 2
GiB = 1 << 30


def train(device: str, between_steps: Callable[[], None] = lambda: None) -> float:
    """Build the model (untimed), then run and time ``STEPS`` training steps."""
    with default_dtype(torch.bfloat16), torch.device(device):
        model = GPT(CONFIG)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    tokens = torch.randint(0, CONFIG.vocab_size, (1, SEQ + 1), device=device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    gc.collect()
    start = time.perf_counter()
    for step in range(STEPS):
        if step:
            between_steps()
        training_step(model, optimizer, inputs, targets)
    return time.perf_counter() - start


def run_plain() -> float:
    with FakeTensorMode():
        return train("cpu")


def run_sim() -> tuple[float, int]:
    backend = SimBackend()
    backend.begin_test()
    try:
        seconds = train("cuda")
        return seconds, backend.peak_allocated()
    finally:
        backend.end_test()


def run_memtracker() -> tuple[float, int]:
    with FakeTensorMode():
        tracker = MemTracker()
        with tracker:
            seconds = train("cpu", tracker.reset_mod_stats)
        peak = max(dev["Total"] for dev in tracker.get_tracker_snapshot("peak").values())
    return seconds, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of plain and sim")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    parser.add_argument("--skip-memtracker", action="store_true", help="plain and sim only")
    args = parser.parse_args()

    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(f"{STEPS} training steps of a {CONFIG.num_layers}-layer, 32.8B-parameter GPT, bf16, "
          f"{SEQ} tokens; {args.rounds} rounds")  # fmt: skip
    run_plain()  # warm-up: FakeTensorMode's dispatch cache, lazy imports
    run_sim()
    plain: list[float] = []
    sim: list[float] = []
    sim_peak = 0
    for i in range(args.rounds):
        # Alternate which goes first, so that neither always runs on a warmer machine.
        if i % 2:
            seconds, sim_peak = run_sim()
            plain.append(run_plain())
        else:
            plain.append(run_plain())
            seconds, sim_peak = run_sim()
        sim.append(seconds)
        print(
            f"  round {i + 1}: plain {plain[-1]:.2f} s, sim {sim[-1]:.2f} s, "
            f"ratio {sim[-1] / plain[-1]:.3f}",
            flush=True,
        )
    results: dict[str, object] = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "steps": STEPS,
        "rounds": args.rounds,
        "plain_seconds": plain,
        "sim_seconds": sim,
        "plain_median": statistics.median(plain),
        "sim_median": statistics.median(sim),
        "sim_over_plain": statistics.median(s / p for s, p in zip(sim, plain, strict=True)),
        "sim_over_plain_medians": statistics.median(sim) / statistics.median(plain),
        "sim_over_plain_best": min(sim) / min(plain),
        "sim_peak_bytes": sim_peak,
    }
    print(f"plain FakeTensorMode: median {results['plain_median']:.2f} s (best {min(plain):.2f})")
    print(f"sim backend:          median {results['sim_median']:.2f} s (best {min(sim):.2f})")
    print(f"sim / plain:          {results['sim_over_plain']:.3f} (median of the rounds' ratios; "
          f"of the medians {results['sim_over_plain_medians']:.3f}, "
          f"best against best {results['sim_over_plain_best']:.3f})")  # fmt: skip
    if not args.skip_memtracker:
        print("MemTracker (one run)...", flush=True)
        mem_seconds, mem_peak = run_memtracker()
        results.update(
            memtracker_seconds=mem_seconds,
            memtracker_over_sim=mem_seconds / statistics.median(sim),
            memtracker_peak_bytes=mem_peak,
            peak_difference=(sim_peak - mem_peak) / mem_peak,
        )
        print(f"MemTracker:           {mem_seconds:.2f} s")
        print(f"MemTracker / sim:     {results['memtracker_over_sim']:.1f}")
        print(f"peak: sim {sim_peak / GiB:.3f} GiB, MemTracker {mem_peak / GiB:.3f} GiB, "
              f"difference {results['peak_difference']:+.4%}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
