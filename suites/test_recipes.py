"""The source articles' memory recipes, each measured against its counterpart on one device.

The repository's GPT at the Qwen2.5-32B shape (32,763,876,352 parameters), in bf16, on the
simulated device (``sim``, shape-only: a 32B step takes seconds), and a 4.5B model of the same
family for the MIG slices. ``docs/recipes.md`` puts each figure beside the articles' claim and
the estimator's answer.

Each test measures the counterpart inside ``vram.measure()`` and the recipe with
``vram.single_step``: the counterpart's peak is the test's peak (``peak_allocated``) and the
recipe's is ``single_step_peak``, so the baseline holds both, and the saving between them is
asserted within a stated range. The capacity tests store the largest batch that fits
(``max_size``). Each test runs for seconds to tens of seconds: all are marked ``slow``
(``pytest suites --run-slow``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gpt import GPT, GPTConfig, KVCache, default_dtype, training_step
from recipes import (
    CONFIG_4_5B,
    CONTEXT,
    HostAdamW,
    checkpoint_feed_forward,
    quantized_gpt,
    serving_step,
    weight_bytes,
)

pytestmark = pytest.mark.vram_backend("sim")

CONFIG = GPTConfig.qwen2_5_32b()
PARAMS = 32_763_876_352
SEQ = 512


def bf16_model(config: GPTConfig = CONFIG) -> GPT:
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        return GPT(config)


def sequences(batch: int, seq: int = SEQ) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, CONFIG.vocab_size, (batch, seq + 1), device="cuda")
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.slow
def test_the_optimizer_on_the_host_frees_60_percent_of_a_32b_step(vram):
    model = bf16_model()
    batch = sequences(1)
    # The counterpart: AdamW on the device, its moments in bf16 beside the bf16 weights. Its
    # step peaks at 10 bytes a parameter: weights, gradients, two moments and the square roots
    # CUDA's foreach AdamW takes of every second moment at once.
    on_device = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with vram.measure() as device_step:
        training_step(model, on_device, *batch)
    del on_device
    # The recipe: fp32 master weights and moments on the host; the device keeps 4 bytes a
    # parameter (weights and gradients) and the activations.
    on_host = HostAdamW(model.parameters())
    host_step = vram.single_step(lambda: training_step(model, on_host, *batch))
    assert 10 * PARAMS <= device_step.peak <= 10.1 * PARAMS
    assert 4 * PARAMS <= host_step.peak <= 4.1 * PARAMS
    # The articles' "about 60%" holds against bf16 AdamW on the device: 1 - 4/10.
    saving = 1 - host_step.peak / device_step.peak
    assert 0.58 <= saving <= 0.61, f"the host optimizer saved {saving:.1%}"
    # Nothing of the optimizer stays on the device after the step.
    assert host_step.after == host_step.before


@pytest.mark.slow
def test_checkpointing_only_the_feed_forward_blocks_saves_over_half_the_activations(vram):
    model = bf16_model()
    batch = sequences(1)
    # Activation memory: what a forward pass leaves for the backward pass (the loss keeps it).
    kept = {}
    for recipe in ("none", "every block"):
        model.checkpointing = recipe == "every block"
        with vram.measure() as forward:
            loss = model.loss(*batch)
        kept[recipe] = forward.end - forward.start
        del loss
    model.checkpointing = False
    with checkpoint_feed_forward(model):
        forward = vram.single_step(lambda: model.loss(*batch))
    kept["feed-forward"] = forward.after - forward.before
    del forward
    saving = 1 - kept["feed-forward"] / kept["none"]
    # The SwiGLU block keeps gate, silu(gate), up and their product, each 5.4 hidden widths:
    # more than half of a layer's activations, not the articles' 40%.
    assert 0.55 <= saving <= 0.62, f"checkpointing the feed-forward blocks saved {saving:.1%}"
    assert kept["every block"] < kept["feed-forward"] < kept["none"]


@pytest.mark.slow
@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_weights_shrink_a_32b_prefill(vram, bits):
    prompts = torch.randint(0, CONFIG.vocab_size, (1, SEQ), device="cuda")
    model = bf16_model().eval()
    bf16_weights = weight_bytes(model)
    with vram.measure() as bf16, torch.no_grad():
        model(prompts)
    del model
    model = quantized_gpt(CONFIG, bits, "cuda").eval()
    weights = weight_bytes(model)

    def prefill() -> None:
        with torch.no_grad():
            model(prompts)

    quantized = vram.single_step(prefill)
    # Linear weights at bits/16 of bf16, plus bf16 scales; the embedding stays bf16 (1.56 GB).
    assert weights / bf16_weights == pytest.approx({8: 0.512, 4: 0.268}[bits], abs=0.005)
    # Weights are most of an inference peak: the rest is one layer dequantized on the fly and
    # the prompt's activations and logits.
    bf16_share, share = bf16_weights / bf16.peak, weights / quantized.peak
    assert bf16_share >= 0.95
    assert {8: 0.88, 4: 0.75}[bits] <= share <= 0.97, f"weights are {share:.1%} of the peak"
    ratio = quantized.peak / bf16.peak
    assert {8: 0.52, 4: 0.30}[bits] <= ratio <= {8: 0.60, 4: 0.37}[bits], ratio


@pytest.mark.slow
def test_accumulating_four_sequences_peaks_lower_than_a_batch_of_four(vram):
    seq = 4096
    model = bf16_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    # A first step makes AdamW's moments, which every later step holds through its backward.
    for param in model.parameters():
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    # Four 4096-token sequences at once keep four sequences' activations through the forward...
    with vram.measure() as large:
        training_step(model, optimizer, *sequences(4, seq))
    micro_batches = [sequences(1, seq) for _ in range(4)]

    def accumulate() -> None:
        for tokens, targets in micro_batches:
            (model.loss(tokens, targets) / len(micro_batches)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    # ...four micro-batches one sequence's, with the gradients summed across them.
    accumulated = vram.single_step(accumulate)
    ratio = accumulated.peak / large.peak
    assert 0.55 <= ratio <= 0.65, f"accumulation peaked at {ratio:.1%} of the large batch"
    # Both peak at the start of a backward pass: weights, moments and the gradients arriving
    # (8 bytes a parameter), and the activations of one sequence or of four.
    assert accumulated.peak >= 8 * PARAMS


def request_bytes(config: GPTConfig) -> int:
    """The bf16 KV cache of one request's whole context."""
    return KVCache(config, 1, CONTEXT, "meta", dtype=torch.bfloat16).nbytes


def largest_batch_served(vram, model: GPT, config: GPTConfig, capacity: str) -> int:  # type: ignore[no-untyped-def]
    """The most requests of a 4096-token context (a 2048-token prompt prefilled) that fit."""
    # The cache alone bounds the search: no batch above what the capacity holds of it.
    hi = max(2, int(float(capacity.removesuffix("GB")) * 1e9) // request_bytes(config))
    result = vram.max_size(
        lambda batch: serving_step(model, config, batch, "cuda"), capacity, lo=1, hi=hi
    )
    return result.value


def check_served(served: int, capacity: str, weights: int, config: GPTConfig) -> None:
    # What the capacity holds beside the weights, in whole KV caches, bounds the batch...
    room = max(0, int(float(capacity.removesuffix("GB")) * 1e9) - weights)
    bound = room // request_bytes(config)
    assert served <= bound, (served, bound)
    # ...and each request's prefill (its prompt's activations and logits) takes about as much
    # again at the peak.
    assert served >= 0.35 * bound - 1, (served, bound)


@pytest.mark.slow
@pytest.mark.parametrize("capacity", ["10GB", "20GB", "40GB"])
@pytest.mark.parametrize("bits", [16, 8])
def test_a_mig_slice_serves_a_4_5b_model(vram, capacity, bits):
    model = bf16_model(CONFIG_4_5B) if bits == 16 else quantized_gpt(CONFIG_4_5B, bits, "cuda")
    served = largest_batch_served(vram, model.eval(), CONFIG_4_5B, capacity)
    check_served(served, capacity, weight_bytes(model), CONFIG_4_5B)
    # bf16 weights (9.1 GB) leave a 10 GB slice no room for one request; int8 (5.0 GB) does.
    if capacity == "10GB":
        assert (served > 0) == (bits == 8)


@pytest.mark.slow
@pytest.mark.parametrize("capacity", ["64GB", "128GB"])
def test_a_128gb_device_serves_the_32b_model_in_bf16(vram, capacity):
    model = bf16_model().eval()
    served = largest_batch_served(vram, model, CONFIG, capacity)
    check_served(served, capacity, weight_bytes(model), CONFIG)
    # 65.5 GB of bf16 weights: half of 128 GB, and more than one 64 GB die of an MI250X.
    assert (served > 0) == (capacity == "128GB")


@pytest.mark.slow
def test_pytest_vram_fit_answers_what_max_size_answers_for_a_20gb_slice(vram):
    model = bf16_model(CONFIG_4_5B).eval()
    served = largest_batch_served(vram, model, CONFIG_4_5B, "20GB")
    del model
    # The same step through the command a user runs before any test exists.
    command = [sys.executable, "-m", "pytest_vram", "fit", "--build", "recipes:serve_4_5b"]
    command += ["--capacity", "20GB", "--max-batch", "64", "--json"]
    run = subprocess.run(
        command, cwd=Path(__file__).parent, capture_output=True, text=True, check=True
    )
    (layout,) = json.loads(run.stdout)["layouts"]
    (answer,) = layout["fits"]
    assert answer["max_batch"] == served
