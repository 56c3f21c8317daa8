"""A training step of the repository's GPT under the three scenarios of a memory test:
idle after emptying the cache, one step's peak against a budget, and 20 steps for a leak.

Written for CUDA: on a GPU runner it measures the real device; on a CPU-only runner the default
backend simulates one (``--vram-backend=cpu`` runs it for real on the CPU instead).
"""

import pytest
import torch
from gpt import GPT, GPTConfig, parameter_count, training_step

from pytest_vram import max_vram

CONFIG = GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2)
BATCH, SEQ = 4, 128
FLOAT32 = 4

# The budget of one step, from what it must hold: fp32 weights, gradients and the two AdamW
# moments are 16 bytes per parameter (3,344,640 parameters: 53.5 MB); the activations of a
# 4 x 128 token batch, the logits and the loss add about 40 MB. cuBLAS holds a workspace per
# thread that multiplies, the forward's and autograd's: 2 x 32 MiB (67.1 MB) on Hopper, on a GPU
# as on sim. 160 MB leaves room for the allocator's rounding, and fails a change that doubles
# the activations or the optimizer's state.
STEP_BUDGET = "160MB"


@pytest.fixture
def model(vram):
    torch.manual_seed(0)
    return GPT(CONFIG).to(vram.device)


@pytest.fixture
def batch(vram):
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ + 1), device=vram.device)
    return tokens[:, :-1], tokens[:, 1:]


def test_idle_memory_is_the_weights(vram, model):
    idle = vram.empty_cache()
    weights = parameter_count(model) * FLOAT32
    tensors = len(list(model.parameters()))
    # Each parameter is one allocation; a CUDA-like allocator rounds each up to 512 bytes.
    assert weights <= idle <= weights + 512 * tensors


@max_vram(STEP_BUDGET)
def test_training_step_fits_its_budget(vram, model, batch):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    step = vram.single_step(lambda: training_step(model, optimizer, *batch))
    # After the first step AdamW holds two fp32 moments per parameter.
    states = 2 * parameter_count(model) * FLOAT32
    assert step.after - step.before >= states
    # The peak holds the weights, the new moments, the gradients and the activations.
    assert step.peak > step.before + states


def test_training_does_not_leak(vram, model):
    # A short batch keeps the real steps quick on the cpu backend; a leak shows at any size.
    # 20 steps are the fewest the check judges in its ten blocks, and catch a leak that grows
    # at least every fourth step (a step that keeps its loss, its graph or its gradients).
    tokens = torch.randint(0, CONFIG.vocab_size, (2, 33), device=vram.device)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    result = vram.leak_check(lambda: training_step(model, optimizer, inputs, targets), steps=20)
    assert len(result.per_step) == 20
    assert result.growth == 0


def test_gradient_checkpointing_lowers_the_peak(vram):
    tokens = torch.randint(0, CONFIG.vocab_size, (BATCH, SEQ), device=vram.device)
    peaks = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT(CONFIG, checkpointing=checkpointing).to(vram.device)
        with vram.measure() as measured:
            model.loss(tokens, tokens).backward()
        peaks[checkpointing] = measured.delta
        del model
    assert peaks[True] < peaks[False]
