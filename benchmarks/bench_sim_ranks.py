"""What simulated ranks cost: a training step as rank 0 of 8 under FSDP2 against the same step
on one simulated device, measured in one run.

The model: the repository's GPT at the Qwen2.5-32B shape (hidden 5120, 40 heads, 8 KV heads,
FFN 27648, vocab 152064) with ``--layers`` blocks (default 16, 9.4B parameters; 64 is the full
32.8B model, and takes four times as long), one 512-token sequence, fp32 parameters with bf16
compute, AdamW (foreach, as on CUDA), two steps from a fresh optimizer. Two ways to run it, both
on the sim backend:

- single: one device, the whole model, ``torch.autocast("cuda", dtype=torch.bfloat16)``;
- ranks: rank 0 of a fake process group of 8 (what ``vram_world_size(8)`` sets up), the model
  made on the meta device, ``fully_shard`` per block and for the root with
  ``MixedPrecisionPolicy(param_dtype=bfloat16)``, then materialised (``to_empty``).

Only the steps are timed; building and sharding are reported apart. The two alternate for
``--rounds`` rounds after a warm-up round each, so that both see the same machine, and the
median of the rounds' ratios is reported. Run from the repository root:

    python benchmarks/bench_sim_ranks.py [--layers 16] [--rounds 5] [--json results.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "suites"))

from gpt import GPT, GPTConfig, parameter_count  # noqa: E402

from pytest_vram.backends.sim.backend import SimBackend  # noqa: E402
from pytest_vram.backends.sim.ranks import SimulatedRanks  # noqa: E402

SEQ = 512
STEPS = 2
RANKS = 8
GiB = 1 << 30


def steps(model: GPT, config: GPTConfig, autocast: bool) -> float:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)
    tokens = torch.randint(0, config.vocab_size, (1, SEQ + 1), device="cuda")
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    gc.collect()
    start = time.perf_counter()
    for _ in range(STEPS):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model.loss(inputs, targets)
        loss.backward()
        del loss
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def run_single(config: GPTConfig) -> tuple[float, float, int]:
    """(setup seconds, step seconds, peak bytes) on one simulated device."""
    backend = SimBackend()
    backend.begin_test()
    try:
        start = time.perf_counter()
        with torch.device("cuda"):
            model = GPT(config)
        setup = time.perf_counter() - start
        return setup, steps(model, config, autocast=True), backend.peak_allocated()
    finally:
        backend.end_test()


def run_ranks(config: GPTConfig) -> tuple[float, float, int]:
    """(setup seconds, step seconds, peak bytes) as rank 0 of 8 under FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    backend = SimBackend()
    start = time.perf_counter()
    ranks = SimulatedRanks(RANKS, backend)
    ranks.start()
    backend.begin_test()
    try:
        mesh = init_device_mesh("cuda", (RANKS,))
        with torch.device("meta"):
            model = GPT(config)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device="cuda")
        setup = time.perf_counter() - start
        return setup, steps(model, config, autocast=False), backend.peak_allocated()
    finally:
        backend.end_test()
        ranks.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16, help="blocks of the 32B shape")
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds of each")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    config = dataclasses.replace(GPTConfig.qwen2_5_32b(), num_layers=args.layers)
    with torch.device("meta"):
        params = parameter_count(GPT(config))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(f"{STEPS} training steps of a {args.layers}-layer, {params / 1e9:.1f}B-parameter GPT "
          f"at the Qwen2.5-32B shape, fp32 weights, bf16 compute, {SEQ} tokens; "
          f"{args.rounds} rounds")  # fmt: skip
    run_single(config)  # warm-up: FakeTensorMode's dispatch cache, lazy imports
    run_ranks(config)
    single: list[float] = []
    ranked: list[float] = []
    setups: dict[str, list[float]] = {"single": [], "ranks": []}
    peaks = {"single": 0, "ranks": 0}
    for i in range(args.rounds):
        # Alternate which goes first, so that neither always runs on a warmer machine.
        order = ("ranks", "single") if i % 2 else ("single", "ranks")
        for name in order:
            setup, seconds, peaks[name] = (run_single if name == "single" else run_ranks)(config)
            setups[name].append(setup)
            (single if name == "single" else ranked).append(seconds)
        print(
            f"  round {i + 1}: single {single[-1]:.2f} s, {RANKS} ranks {ranked[-1]:.2f} s, "
            f"ratio {ranked[-1] / single[-1]:.3f}",
            flush=True,
        )
    ratio = statistics.median(r / s for r, s in zip(ranked, single, strict=True))
    results = {
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "layers": args.layers,
        "parameters": params,
        "steps": STEPS,
        "rounds": args.rounds,
        "single_seconds": single,
        "ranks_seconds": ranked,
        "single_setup_median": statistics.median(setups["single"]),
        "ranks_setup_median": statistics.median(setups["ranks"]),
        "ranks_over_single": ratio,
        "single_peak_bytes": peaks["single"],
        "ranks_peak_bytes": peaks["ranks"],
    }
    for name, times in (("single device", single), (f"{RANKS} ranks", ranked)):
        key = "single" if times is single else "ranks"
        print(
            f"{name + ':':15}median {statistics.median(times):.2f} s (best {min(times):.2f}), "
            f"setup {results[key + '_setup_median']:.2f} s, peak {peaks[key] / GiB:.1f} GiB"
        )
    print(f"{RANKS} ranks / single: {ratio:.3f} (median of the rounds' ratios)")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
