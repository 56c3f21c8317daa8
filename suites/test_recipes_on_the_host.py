"""The recipes that keep tensors on the host, measured at the Qwen2.5-32B shape where the
simulated device keeps host tensors on the host, as a GPU does: activations saved on the host
(``torch.autograd.graph.save_on_cpu``) and FSDP2's ``CPUOffloadPolicy`` on eight ranks.

    pytest suites/test_recipes_on_the_host.py --run-slow --vram-report \\
        --vram-sim-host-tensors=host --vram-baseline-dir baselines/host-tensors

Elsewhere (the default, where every tensor a test makes is the device's) the test skips: the
host copies would count as device memory. Its baselines live in a folder of their own, since a
baseline file holds one setting.
"""

from __future__ import annotations

import gc

import pytest
import torch
from gpt import GPT, GPTConfig, default_dtype, training_step
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from pytest_vram import vram_world_size

pytestmark = pytest.mark.vram_backend("sim")

CONFIG = GPTConfig.qwen2_5_32b()
SEQ = 512


@pytest.fixture
def host_tensors_on_the_host(pytestconfig: pytest.Config) -> None:
    setting = pytestconfig.getoption("--vram-sim-host-tensors", None) or pytestconfig.getini(
        "vram_sim_host_tensors"
    )
    if setting != "host":
        pytest.skip("measured with --vram-sim-host-tensors=host")


@pytest.mark.slow
@pytest.mark.usefixtures("host_tensors_on_the_host")
def test_activations_saved_on_the_host_leave_the_device(vram):
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = GPT(CONFIG)
    tokens = torch.randint(0, CONFIG.vocab_size, (1, SEQ + 1), device="cuda")
    batch = tokens[:, :-1], tokens[:, 1:]
    # Activation memory: what a forward pass leaves on the device for the backward pass.
    with vram.measure() as forward:
        loss = model.loss(*batch)
    kept = forward.end - forward.start
    del loss
    with vram.measure() as forward, torch.autograd.graph.save_on_cpu(pin_memory=True):
        loss = model.loss(*batch)
    kept_on_the_host = forward.end - forward.start
    del loss

    def on_the_host() -> None:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            loss = model.loss(*batch)
        loss.backward()
        model.zero_grad(set_to_none=True)

    # Backward brings each saved tensor back as it needs it: the step's peak is the weights,
    # their gradients and a layer's worth.
    step = vram.single_step(on_the_host)
    # 64 layers' activations of 512 tokens (and the logits) stay on the device without it;
    # with it, only the loss: every tensor saved for backward waits on the host.
    assert kept > 5 * 2**30
    assert kept_on_the_host < 2**20, f"save_on_cpu left {kept_on_the_host} bytes on the device"
    # What stays is the cuBLAS workspace of autograd's thread, made by the first backward.
    assert step.after - step.before == 32 * 2**20


RANKS = 8
MIXED = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def sharded(offload: bool) -> GPT:
    """The 32B GPT under FSDP2 on eight ranks (fp32 shards, bf16 compute), its shards on the
    host with ``CPUOffloadPolicy`` (``offload``) or on the device."""
    with torch.device("meta"):
        model = GPT(CONFIG)
    mesh = init_device_mesh("cuda", (RANKS,))
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=MIXED, **policy)
    fully_shard(model, mesh=mesh, mp_policy=MIXED, **policy)
    model.to_empty(device="cpu" if offload else "cuda")
    return model


@pytest.mark.slow
@pytest.mark.usefixtures("host_tensors_on_the_host")
@vram_world_size(RANKS)
def test_fsdp2_cpu_offload_frees_70_percent_of_a_32b_rank(vram):
    tokens = torch.randint(0, CONFIG.vocab_size, (1, SEQ + 1), device="cuda")
    batch = tokens[:, :-1], tokens[:, 1:]
    model = sharded(offload=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    with vram.measure() as counterpart:
        training_step(model, optimizer, *batch)
    del model, optimizer
    gc.collect()  # FSDP2's modules and hooks hold each other
    model = sharded(offload=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    step = vram.single_step(lambda: training_step(model, optimizer, *batch))
    # The shards (4 bytes a parameter over eight ranks), their gradients and AdamW's moments
    # stay on the host; the device holds a block's gathered bf16 weights at a time, the
    # gradients before they are reduced and moved, and the activations. Before the step it
    # holds the cuBLAS workspaces of the step's and autograd's threads and the tokens.
    assert step.before == step.after < 2 * 32 * 2**20 + 2**20
    saving = 1 - step.peak / counterpart.peak
    assert 0.65 <= saving <= 0.75, f"CPUOffloadPolicy saved {saving:.1%}"
