"""The 32B decoder fine-tuned on 8 simulated ranks: FSDP2, and tensor parallel 2 x FSDP 4.

The repository's GPT at the Qwen2.5-32B shape (32,763,876,352 parameters), one 512-token
sequence per rank, as one rank of eight sees it: ``vram_world_size(8)`` runs each test as
rank 0 of a fake process group on the ``sim`` backend, so ``fully_shard`` and
``parallelize_module`` shard exactly as on eight GPUs, and the figures are that rank's.

Parameters are made on the meta device, sharded, then materialised on the device
(``to_empty``), as FSDP2 loads a model that does not fit one GPU.

Precision: FSDP2 keeps fp32 parameter shards and gathers them in bf16 for compute
(``MixedPrecisionPolicy(param_dtype=bfloat16)``); gradients reach the shards in fp32 and AdamW's
moments are fp32: 4 + 4 + 8 = 16 bytes a parameter, over 8 ranks. The estimator's bf16 training
counts the same 16 bytes as ZeRO's paper splits them, bf16 weights and gradients (2 + 2) and fp32
master weights and moments in the optimizer (12); under FSDP2 the fp32 shard is the master and
the bf16 weights exist only while a layer is gathered (the estimator's ``zero3_gathered``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gpt import GPT, GPTConfig, parameter_count, training_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)

from pytest_vram import max_vram, vram_world_size
from pytest_vram.estimate import Estimate, estimate

pytestmark = pytest.mark.vram_backend("sim")

CONFIG = GPTConfig.qwen2_5_32b()
PARAMS = 32_763_876_352
SEQ = 512
RANKS = 8
QWEN_CONFIG = Path(__file__).resolve().parents[1] / "tests" / "configs" / "qwen2.5-32b.json"
MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16)


def step_budget(result: Estimate) -> int:
    """A rank's budget for one training step, from the estimate.

    The estimate covers the backward pass: model states, activations, logits and the gathered
    layer. It leaves out the optimizer step's temporaries, and CUDA's default foreach AdamW
    takes the square root of every second moment at once: one more fp32 copy of the moments'
    shards, a third of the optimizer term (master, m and v). That step, after the activations
    are gone, is where a sharded step peaks; 1% more covers the allocator's rounding and
    AdamW's step counters, and fails a change that keeps 0.8 GB more.
    """
    terms = result.breakdown
    states = terms["weights"] + terms["gradients"] + terms["optimizer"]
    foreach_step = states + terms["optimizer"] // 3
    return int(1.01 * max(result.per_gpu_bytes, foreach_step))


FSDP_ESTIMATE = estimate(
    config=QWEN_CONFIG, mode="train", dtype="bf16", gpus=RANKS, zero=3, seq=SEQ
)
TP_ESTIMATE = estimate(
    config=QWEN_CONFIG, mode="train", dtype="bf16", gpus=RANKS, tp=2, zero=3, seq=SEQ
)
# 82.7 GB each: model states of 65.5 GB, plus 16.4 GB for the foreach step.
FSDP_BUDGET = step_budget(FSDP_ESTIMATE)
TP_BUDGET = step_budget(TP_ESTIMATE)

# Megatron's split, the one the estimator's tp models: Q, K, V, gate and up by output rows,
# O and down by input columns, the embedding and the output layer by vocabulary.
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


def meta_model() -> GPT:
    with torch.device("meta"):
        return GPT(CONFIG)


def shard(model: GPT, mesh) -> GPT:  # type: ignore[no-untyped-def]
    """FSDP2 per block and for the rest, then the shards materialised on the device."""
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MIXED)
    fully_shard(model, mesh=mesh, mp_policy=MIXED)
    model.to_empty(device="cuda")
    return model


@pytest.fixture
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (1, SEQ + 1), device="cuda")
    return tokens[:, :-1], tokens[:, 1:]


# What cuBLAS holds besides the model: a 32 MiB workspace (Hopper, the simulated GPU's default
# model) for each thread that ran a matrix multiply, the step's and autograd's among them.
WORKSPACES = 4 * 32 * 2**20


def about(measured: int, expected: int) -> bool:
    """``expected``, counted as CUDA's allocator counts it: each tensor is handed a whole block,
    with a remainder of up to 1 MiB that the allocator does not split off (about 0.6% over
    these shards' hundreds of tensors), plus what cuBLAS's workspaces may hold."""
    return expected <= measured <= expected * 1.01 + WORKSPACES


def check_step(vram, model: GPT, batch: tuple[torch.Tensor, torch.Tensor]) -> None:  # type: ignore[no-untyped-def]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = vram.single_step(lambda: training_step(model, optimizer, *batch))
    shard_bytes = 4 * PARAMS // RANKS  # one fp32 copy of the parameters, over eight ranks
    # Before: the fp32 parameter shards. After: those and AdamW's two fp32 moments.
    assert about(step.before, shard_bytes), step.before
    assert about(step.after - step.before, 2 * shard_bytes), step.after - step.before
    # The peak: parameters, gradients, moments and the foreach square roots, 5 shards.
    assert about(step.peak, 5 * shard_bytes), step.peak


@max_vram(FSDP_BUDGET)
@vram_world_size(RANKS)
def test_32b_fsdp2_step_on_8_ranks_fits_the_estimate(vram, batch):
    model = meta_model()
    assert parameter_count(model) == PARAMS == FSDP_ESTIMATE.parameters
    mesh = init_device_mesh("cuda", (RANKS,))
    check_step(vram, shard(model, mesh), batch)


# The gathered logits are a view; FSDP2 warns of in-place ops on it, and the loss makes none.
@pytest.mark.filterwarnings("ignore:FSDP2-wrapped module:UserWarning")
@max_vram(TP_BUDGET)
@vram_world_size(RANKS)
def test_32b_tensor_parallel_2_by_fsdp2_4_fits_the_estimate(vram, batch):
    mesh = init_device_mesh("cuda", (4, 2), mesh_dim_names=("dp", "tp"))
    model = meta_model()
    for block in model.blocks:
        parallelize_module(block, mesh["tp"], BLOCK_PLAN)
    parallelize_module(model, mesh["tp"], OUTER_PLAN)
    check_step(vram, shard(model, mesh["dp"]), batch)
