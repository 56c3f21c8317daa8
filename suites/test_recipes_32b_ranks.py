"""The articles' three typical configurations of a 32B model, measured on simulated ranks.

The repository's GPT at the Qwen2.5-32B shape (32,763,876,352 parameters), as rank 0 of each
layout sees it (``vram_world_size``: a fake process group on the simulated device). Each test
measures a step of one sequence or request (``single_step_peak`` in the baseline) and the
largest batch that fits the card's memory (``max_size``), and compares both with the
analytical estimator. ``docs/recipes.md`` has the table, beside the articles' own estimates.
Each takes tens of seconds: they are marked ``slow`` (``pytest suites --run-slow``).

The capacities are the memory PyTorch reports for each card (``total_memory``): an A100 80GB
has 79.15 GiB, an A100 40GB 39.39 GiB, an RTX A6000 47.54 GiB.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpt import GPT, GPTConfig, KVCache, default_dtype, training_step
from recipes import (
    CONTEXT,
    HostAdamW,
    quantized_gpt,
    serving_step,
    shard_config,
    weight_bytes,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from pytest_vram import vram_world_size
from pytest_vram.estimate import estimate

pytestmark = [pytest.mark.vram_backend("sim"), pytest.mark.slow]

CONFIG = GPTConfig.qwen2_5_32b()
QWEN_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "configs" / "qwen2.5-32b.json"
SEQ = 512
A100_80GB = int(79.15 * 2**30)
A100_40GB = int(39.39 * 2**30)
A6000 = int(47.54 * 2**30)

# Megatron's split, as the estimator's tp models it.
BLOCK_PLAN = {
    "attention.q_proj": ColwiseParallel(),
    "attention.k_proj": ColwiseParallel(),
    "attention.v_proj": ColwiseParallel(),
    "attention.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}
OUTER_PLAN = {
    "embed": RowwiseParallel(input_layouts=Replicate()),
    "lm_head": ColwiseParallel(output_layouts=Replicate()),
}


def tensor_parallel(ranks: int, dtype: torch.dtype) -> GPT:
    """The GPT split over ``ranks`` tensor-parallel ranks, this rank's shards on the device."""
    mesh = init_device_mesh("cuda", (ranks,))
    with default_dtype(dtype), torch.device("meta"):
        model = GPT(CONFIG)
    for block in model.blocks:
        parallelize_module(block, mesh, BLOCK_PLAN)
    parallelize_module(model, mesh, OUTER_PLAN)
    return model.to_empty(device="cuda")


def sequences(batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (batch, SEQ + 1), device="cuda")
    return tokens[:, :-1], tokens[:, 1:]


def estimated_batch(capacity: int, **layout) -> int:  # type: ignore[no-untyped-def]
    """The largest batch whose estimate fits ``capacity`` (0: not one sequence)."""
    batch = 0
    while estimate(config=QWEN_CONFIG, batch=batch + 1, **layout).per_gpu_bytes <= capacity:
        batch += 1
    return batch


@vram_world_size(8)
def test_development_on_8_a100_80gb_in_tensor_parallel_and_mixed_precision_does_not_fit(vram):
    model = tensor_parallel(8, torch.float32)
    # The sharded weights and the replicated norms step in groups of their own: a foreach op
    # takes DTensors or plain tensors, not both.
    sharded = [p for p in model.parameters() if hasattr(p, "to_local")]
    replicated = [p for p in model.parameters() if not hasattr(p, "to_local")]
    optimizer = torch.optim.AdamW([{"params": sharded}, {"params": replicated}], lr=1e-5)

    def step(batch: int) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(*sequences(batch))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    one = vram.single_step(lambda: step(1))
    largest = vram.max_size(step, A100_80GB, hi=16)
    layout = {"mode": "train", "dtype": "bf16", "gpus": 8, "tp": 8, "seq": SEQ}
    estimated = estimate(config=QWEN_CONFIG, **layout).per_gpu_bytes
    # Model states are 16 bytes a parameter over 8 ranks (65.5 GB), and CUDA's foreach AdamW
    # adds an fp32 square root of every second moment (16.4 GB): past the card before any
    # activation. The estimate leaves the step's temporaries out and answers 15 sequences.
    assert one.peak > A100_80GB
    assert largest.value == 0
    assert 1.2 <= one.peak / estimated <= 1.35
    assert estimated_batch(A100_80GB, **layout) >= 8


@vram_world_size(4)
def test_serving_on_4_a100_40gb_with_the_optimizer_on_the_host_fits_what_the_estimator_says(vram):
    model = tensor_parallel(4, torch.bfloat16)
    optimizer = HostAdamW(model.parameters())

    def step(batch: int) -> None:
        training_step(model, optimizer, *sequences(batch))

    one = vram.single_step(lambda: step(1))
    largest = vram.max_size(step, A100_40GB, hi=16)
    layout = {"mode": "train", "dtype": "bf16", "gpus": 4, "tp": 4, "seq": SEQ, "zero": 1,
              "offload": "optimizer", "optimizer": "adafactor"}  # fmt: skip
    estimated = estimate(config=QWEN_CONFIG, **layout).per_gpu_bytes
    # bf16 weights and gradients over 4 ranks (16.4 GB each) and the activations: the host's
    # optimizer, Adafactor or AdamW, adds nothing here. The estimator counts the same.
    assert one.peak < A100_40GB
    assert largest.value >= 1
    assert 0.9 <= one.peak / estimated <= 1.1
    assert abs(largest.value - estimated_batch(A100_40GB, **layout)) <= 1


@vram_world_size(2)
def test_the_edge_on_2_a6000_with_8_bit_weights_serves_more_than_the_estimator_says(vram):
    model = quantized_gpt(CONFIG, 8, "cuda", ranks=2).eval()
    cache_shape = shard_config(CONFIG, 2)

    def step(batch: int) -> None:
        serving_step(model, cache_shape, batch, "cuda")

    one = vram.single_step(lambda: step(1))
    largest = vram.max_size(step, A6000, hi=64)
    layout = {"mode": "inference", "dtype": "int8", "gpus": 2, "tp": 2, "seq": 4096}
    estimated = estimate(config=QWEN_CONFIG, **layout).per_gpu_bytes
    # int8 weights over 2 ranks (17.6 GB with the whole bf16 embedding), then 0.54 GB of KV
    # cache a 4096-token request: the caches that fit beside the weights bound the batch, and
    # each request's prefill takes about as much again.
    request = KVCache(cache_shape, 1, CONTEXT, "meta", dtype=torch.bfloat16).nbytes
    bound = (A6000 - weight_bytes(model)) // request
    assert 0.35 * bound <= largest.value <= bound
    # The estimator prefills all 4096 tokens, where the step prefills its 2048-token prompt,
    # so it counts more a request and answers fewer.
    assert 0.95 <= one.peak / estimated <= 1.1
    assert largest.value >= estimated_batch(A6000, **layout)
