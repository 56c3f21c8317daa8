"""A 32B-parameter decoder trained for a step, on the simulated device, in seconds.

The repository's GPT at the Qwen2.5-32B shape (hidden 5120, 64 layers, 40 heads, 8 KV heads,
FFN 27648, vocab 152064): 32,763,876,352 parameters, one 512-token sequence. No GPU has room for
it, so these tests pin the ``sim`` backend, where tensors carry no data and the bytes are counted
as the CUDA caching allocator would hand them out. The code is what one would write for CUDA.
"""

from __future__ import annotations

import pytest
import torch
from gpt import GPT, GPTConfig, default_dtype, parameter_count, training_step
from torch import nn

from pytest_vram import max_vram

pytestmark = pytest.mark.vram_backend("sim")

CONFIG = GPTConfig.qwen2_5_32b()
PARAMS = 32_763_876_352
SEQ = 512

# The budget of a bf16 training step, from what it must hold (P = 32.76e9 parameters, 2 bytes
# each in bf16, AdamW's moments kept in the parameters' dtype):
#   weights                                   2P =  65.5 GB
#   gradients                                 2P =  65.5 GB
#   AdamW's two moments                       4P = 131.1 GB
#   activations kept for backward at 512 tokens:    12.8 GB
#     per block about 38 hidden-sized tensors of 512 x 5120 x 2 bytes (5.2 MB): the RMSNorms'
#     float32 copies, q/k/v and their rotary outputs, attention in and out, and the SwiGLU's
#     gate, up and product (5.4 hidden widths each); 64 blocks, plus 0.8 GB of logits and loss.
# In backward that is 8P + 12.8 GB = 274.9 GB. The optimizer step comes after the activations
# are gone but adds what CUDA's default foreach AdamW makes in one go: the square root of every
# second moment, 2P more, so the step peaks at 10P = 327.6 GB. 330 GB leaves 0.7% for the
# allocator's rounding and fails any change that keeps a further 2.4 GB around.
BF16_STEP_BUDGET = "330GB"

# Mixed precision: float32 master weights, gradients and moments, bf16 compute under autocast.
#   weights 4P, gradients 4P, moments 8P                      = 524.2 GB
#   autocast's bf16 copies of the Linear weights, kept for backward: 2 x 31.98e9 = 64.0 GB
#   bf16 activations (some stay float32: norms, rotary, loss):  13.1 GB
# In backward at most 4P + 8P + 4P + 64.0 + 13.1 GB = 601.3 GB; the foreach step then adds a
# float32 square root of the second moments, 4P, for 20P = 655.3 GB. Budget 660 GB.
MIXED_STEP_BUDGET = "660GB"


def build(device: torch.device, dtype: torch.dtype) -> GPT:
    with default_dtype(dtype), torch.device(device):
        return GPT(CONFIG)


@pytest.fixture
def batch(vram) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (1, SEQ + 1), device=vram.device)
    return tokens[:, :-1], tokens[:, 1:]


@max_vram(BF16_STEP_BUDGET)
def test_32b_training_step_fits_its_budget(vram, batch):
    model = build(vram.device, torch.bfloat16)
    assert parameter_count(model) == PARAMS
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = vram.single_step(lambda: training_step(model, optimizer, *batch))
    # What stays: the two moments AdamW made; what peaked: weights, gradients, moments and
    # the foreach temporary, each 2 bytes a parameter.
    assert step.after - step.before >= 4 * PARAMS
    assert step.peak >= 10 * PARAMS


def test_activation_checkpointing_saves_activation_memory(vram, batch):
    model = build(vram.device, torch.bfloat16)
    kept = {}
    for checkpointing in (False, True):
        model.checkpointing = checkpointing
        with vram.measure() as forward:
            loss = model.loss(*batch)
        # Activation memory: what the forward pass leaves allocated for the backward pass.
        # Letting the loss go frees it with the graph; no backward pass is needed to see it.
        kept[checkpointing] = forward.end - forward.start
        del loss
    # Checkpointing keeps each block's input and recomputes the rest during backward.
    saving = 1 - kept[True] / kept[False]
    assert saving >= 0.40, f"checkpointing saved {saving:.0%} of activation memory"


@max_vram(MIXED_STEP_BUDGET)
def test_32b_mixed_precision_step_fits_its_budget(vram, batch):
    model = build(vram.device, torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def step() -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model.loss(*batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    result = vram.single_step(step)
    assert result.after - result.before >= 8 * PARAMS  # two float32 moments
    assert result.peak >= 20 * PARAMS


def test_mixed_precision_activations_are_smaller(vram, batch):
    model = build(vram.device, torch.float32)
    linear_weights = sum(
        p.numel() for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()
    )
    kept = {}
    for autocast in (False, True):
        autocasting = torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast)
        with vram.measure() as forward, autocasting:
            loss = model.loss(*batch)
        kept[autocast] = forward.end - forward.start
        del loss
    # Autocast keeps a bf16 copy of every Linear weight until the backward pass has used it.
    copies = 2 * linear_weights
    assert kept[True] >= copies
    # The activations themselves are mostly bf16: well under float32 training's.
    assert kept[True] - copies <= 0.75 * kept[False]
