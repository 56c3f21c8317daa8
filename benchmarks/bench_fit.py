"""How long ``vram.max_size`` takes to find the largest micro-batch of a 32B fine-tune that fits
an 80 GB card, on the simulated device, as rank 0 of 8 under FSDP2.

The model: the repository's GPT at the Qwen2.5-32B shape (32,763,876,352 parameters), made on
the meta device, ``fully_shard`` per block and for the root with bf16 compute
(``MixedPrecisionPolicy(param_dtype=bfloat16)``), materialised, activation checkpointing per
block; each attempt is one training step on ``batch`` sequences of ``--seq`` tokens with a fresh
AdamW (``foreach=False``: CUDA's default foreach step takes one more fp32 copy of the moments,
16.4 GB a rank, and then not even one sequence fits 80 GB). What a step needs is the reserved
memory of its segments, as the CUDA caching allocator lays them out, with the capacity set on
them so that an allocation raises where a real 80 GB card would.

The search is timed from its first attempt to its answer, the first attempt included (it pays
for FakeTensorMode's dispatch cache and FSDP2's lazy set-up); building and sharding the model
are reported apart. The machine's load average is printed beside the figure, since the time of
a shape-only step is CPU time. Run from the repository root:

    python benchmarks/bench_fit.py [--capacity 80GB] [--seq 512] [--layers 64] [--json PATH]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
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
from pytest_vram.fit import max_size  # noqa: E402

RANKS = 8
GiB = 1 << 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--capacity", default="80GB", help="the GPU's memory; default: 80GB")
    parser.add_argument("--seq", type=int, default=512, help="tokens a sequence; default: 512")
    parser.add_argument("--layers", type=int, default=64, help="blocks of the 32B shape")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    config = dataclasses.replace(GPTConfig.qwen2_5_32b(), num_layers=args.layers)
    load_before = os.getloadavg()
    backend = SimBackend()
    ranks = SimulatedRanks(RANKS, backend)
    start = time.perf_counter()
    ranks.start()
    backend.begin_test()
    try:
        mesh = init_device_mesh("cuda", (RANKS,))
        with torch.device("meta"):
            model = GPT(config, checkpointing=True)
        params = parameter_count(model)
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)
        model.to_empty(device="cuda")
        setup = time.perf_counter() - start

        def step(batch: int) -> None:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=False)
            tokens = torch.randint(0, config.vocab_size, (batch, args.seq + 1), device="cuda")
            model.loss(tokens[:, :-1], tokens[:, 1:]).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        cpu_start = time.process_time()
        result = max_size(backend, step, args.capacity)
        cpu = time.process_time() - cpu_start
    finally:
        backend.end_test()
        ranks.stop()
    load_after = os.getloadavg()
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, Python {sys.version.split()[0]}")
    print(
        f"a {params / 1e9:.1f}B-parameter GPT at the Qwen2.5-32B shape, rank 0 of {RANKS} "
        f"under FSDP2, bf16 compute, recompute per block, {args.seq} tokens a sequence"
    )
    print(result.describe())
    print(f"sizes tried: {', '.join(str(n) for n in result.tried)} ({len(result.tried)} steps)")
    print(
        f"search: {result.seconds:.1f} s, {cpu:.1f} s of CPU time (model built and sharded in "
        f"{setup:.1f} s); "
        f"load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    if args.json:
        figures = {
            **result.to_dict(),
            "parameters": params,
            "setup_seconds": setup,
            "cpu_seconds": cpu,
            "load_average": [load_before[0], load_after[0]],
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
