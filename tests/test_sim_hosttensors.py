"""Host tensors on the simulated device: what a test keeps on the host is not device memory.

On a GPU, a tensor made without a device is host memory until ``.to("cuda")`` copies it; so is
what is computed from host tensors alone. Each test here says what the CUDA caching allocator
would count for the same code. ``mode`` runs a test shape-only and computing (real CPU tensors).
"""

from __future__ import annotations

import contextlib
import gc
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from simulated_device import simulated as simulated_device
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from pytest_vram.backends.sim.backend import SimBackend

MiB = 1 << 20


def simulated(
    computing: bool = False, workspaces: bool = False
) -> contextlib.AbstractContextManager[SimBackend]:
    """A test on a simulated device that keeps host tensors on the host."""
    return simulated_device(computing, workspaces=workspaces, host_tensors="host")


@pytest.fixture(params=[False, True], ids=["shape-only", "computing"])
def computing(request: pytest.FixtureRequest) -> bool:
    return request.param


@pytest.fixture
def sim(computing: bool) -> Iterator[SimBackend]:
    with simulated(computing) as backend:
        yield backend


def test_a_tensor_made_without_a_device_is_host_memory(sim: SimBackend) -> None:
    host = [torch.zeros(1024), torch.randn(32, 32), torch.tensor([1.0] * 1024), torch.arange(8)]
    assert sim.allocated() == 0
    pinned = torch.empty(1024, device="cpu", pin_memory=True)
    assert sim.allocated() == 0
    on_device = torch.zeros(1024, device="cuda")
    assert sim.allocated() == 4096
    # Naming the host is the host, as on a GPU.
    named = torch.zeros(1024, device="cpu")
    assert sim.allocated() == 4096
    del host, pinned, on_device, named


def test_made_like_a_host_tensor_is_on_the_host(sim: SimBackend) -> None:
    host = torch.ones(1024)
    like = [
        torch.zeros_like(host),
        host.new_zeros(1024),
        torch.as_tensor(host, dtype=torch.float64),
        host.clone(),
    ]
    assert sim.allocated() == 0
    on_device = torch.zeros_like(host, device="cuda")
    assert sim.allocated() == 4096
    # The host's own device named beside host tensors is the host (an optimizer's
    # zeros_like(p, device=p.device)); named alone, it is the simulated device's name.
    beside = torch.zeros_like(host, device=host.device)
    assert sim.allocated() == 4096
    # x.to(other) goes to other's device.
    assert host.to(like[0]) is host
    moved = host.to(on_device)
    assert moved is not host
    assert sim.allocated() == 2 * 4096
    del like, on_device, moved, beside


@pytest.mark.parametrize("default", ["cuda", "cpu"])
def test_a_default_device_makes_its_tensors(sim: SimBackend, default: str) -> None:
    with torch.device(default):
        inside = torch.zeros(1024)
        layer = nn.Linear(32, 32, bias=False)
    assert sim.allocated() == (4096 + 4096 if default == "cuda" else 0)
    assert inside.device.type == layer.weight.device.type == default
    del inside, layer


def test_moving_a_host_tensor_copies_it_to_the_device(sim: SimBackend) -> None:
    host = torch.ones(1024)
    moved = [
        host.cuda(),
        host.to("cuda"),
        host.to(device="cuda:0"),
        host.to(torch.device("cuda"), non_blocking=True),
        host.to(0),
    ]
    assert all(tensor is not host for tensor in moved)
    assert sim.allocated() == 5 * 4096
    # Where it is already: moving it again is the tensor itself, as on CUDA.
    assert moved[0].to("cuda") is moved[0]
    assert moved[0].cuda() is moved[0]
    assert host.to("cpu") is host and host.cpu() is host
    half = host.to("cuda", torch.float16)
    assert sim.allocated() == 5 * 4096 + 2048
    # A dtype alone keeps it on the host.
    host.to(torch.float16)
    assert sim.allocated() == 5 * 4096 + 2048
    # Back to the host: a host copy, which the device does not count.
    back = [moved[0].cpu(), moved[0].to("cpu"), moved[0].to(host)]
    assert all(tensor is not moved[0] for tensor in back)
    assert sim.allocated() == 5 * 4096 + 2048
    del moved, half, back


def test_a_model_built_on_the_host_is_on_the_device_after_to(sim: SimBackend) -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.LayerNorm(256))
    params = list(model.parameters())
    assert sim.peak_allocated() == 0
    assert model.to("cuda") is model
    assert list(model.parameters()) == params  # the same objects, as on CUDA
    weights = 256 * 256 * 4 + 3 * 1024
    assert sim.allocated() == weights
    # The host copies were never the device's: the move's peak is the weights once.
    assert sim.peak_allocated() == weights
    loss = model(torch.randn(8, 256).cuda()).sum()
    loss.backward()
    assert sim.peak_allocated() > 2 * weights


def test_a_step_agrees_shape_only_and_computing() -> None:
    peaks = []
    for computing in (False, True):
        torch.manual_seed(0)
        with simulated(computing, workspaces=True) as sim:
            model = nn.Sequential(nn.Linear(128, 512), nn.GELU(), nn.Linear(512, 128))
            model.to("cuda")
            optimizer = torch.optim.AdamW(model.parameters())
            batch = torch.randn(16, 128).to("cuda")
            model(batch).square().mean().backward()
            optimizer.step()
            peaks.append((sim.peak_allocated(), sim.allocated()))
            del model, optimizer, batch
    assert peaks[0] == peaks[1]


def _forward_keeps(sim: SimBackend, hooks: contextlib.AbstractContextManager[Any]) -> int:
    """The device bytes an 8-layer forward keeps for backward, and a backward that runs."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256, bias=False) for _ in range(8)]).to("cuda")
    x = torch.randn(128, 256, device="cuda", requires_grad=True)
    before = sim.allocated()
    with hooks:
        loss = model(x).square().sum()
    kept = sim.allocated() - before
    loss.backward()
    assert model[0].weight.grad is not None and x.grad is not None
    return kept


def test_activations_saved_on_the_host_are_not_device_memory(sim: SimBackend) -> None:
    # save_on_cpu's pack hook runs inside the op that saves a tensor: its pinned host copy is
    # host memory there too, shape-only and computing, and backward copies each back.
    kept = _forward_keeps(sim, contextlib.nullcontext())
    on_host = _forward_keeps(sim, torch.autograd.graph.save_on_cpu(pin_memory=True))
    # Kept for backward: seven layers' inputs and the last one's output (square saves it),
    # 128 x 256 floats each; the input and the weights were on the device before.
    activations = 8 * 128 * 256 * 4
    assert kept - on_host == activations
    assert on_host == 512  # the loss: every tensor saved for backward is on the host


@pytest.mark.slow
def test_a_transformers_model_built_on_the_host_measures_as_one_built_on_the_device() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    figures = {}
    for computing in (False, True):
        for built_on in ("host", "cuda"):
            torch.manual_seed(0)
            with simulated(computing, workspaces=True) as sim:
                if built_on == "host":
                    model = transformers.LlamaForCausalLM(config)
                    assert sim.peak_allocated() == 0
                    model.to("cuda")
                else:
                    with torch.device("cuda"):
                        model = transformers.LlamaForCausalLM(config)
                optimizer = torch.optim.AdamW(model.parameters())
                ids = torch.randint(0, 100, (2, 64)).to("cuda")
                model(input_ids=ids, labels=ids).loss.backward()
                optimizer.step()
                figures[computing, built_on] = (sim.peak_allocated(), sim.allocated())
                del model, optimizer, ids
    assert len(set(figures.values())) == 1, figures


def test_what_is_computed_from_host_tensors_is_host_memory() -> None:
    with simulated(workspaces=True) as sim:
        x = torch.randn(64, 64, requires_grad=True)
        y = F.softmax(x @ x, dim=-1)
        y.sum().backward()
        assert x.grad is not None
        # No tensor and no cuBLAS workspace: a host matrix product runs on the host.
        assert sim.peak_allocated() == 0
        on_device = x.cuda()
        assert sim.allocated() == 64 * 64 * 4
        # A host scalar beside a device tensor gives a device tensor, as on CUDA.
        scaled = on_device * torch.tensor(2.0)
        assert sim.allocated() == 2 * 64 * 64 * 4
        # The first product on the device makes this thread's cuBLAS workspace.
        product = on_device @ on_device
        assert sim.allocated() == 3 * 64 * 64 * 4 + 32 * MiB
        del y, scaled, product


def test_host_tensors_are_fake_and_cpu_shape_only() -> None:
    with simulated() as sim:
        host = torch.zeros(16)
        assert isinstance(host, FakeTensor)
        assert host.device == torch.device("cpu")
        assert sim.host.is_host(host)
        assert not sim.host.is_host(host.cuda())
        del host
        gc.collect()
        # None left: ops no longer look at their arguments' placement.
        assert sim.host.live == 0


def test_computing_a_host_tensor_is_real_and_its_copy_counted() -> None:
    with simulated(computing=True) as sim:
        host = torch.arange(1024, dtype=torch.float32)
        moved = host.cuda()
        assert not isinstance(moved, FakeTensor)
        assert torch.equal(moved, host)
        assert sim.allocated() == 4096


SUITE = """
import torch
from torch import nn

def test_built_on_the_host(vram):
    model = nn.Linear(1024, 1024, bias=False)   # 4 MiB, on the host
    model.to("cuda")
    tokens = torch.randn(4, 1024)                # on the host
    model(tokens.cuda()).sum().backward()
"""


def test_a_model_built_on_the_host_then_moved_is_measured_as_on_a_gpu(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_host=SUITE)
    result = pytester.runpytest(
        "--vram-backend=sim",
        "--vram-sim-host-tensors=host",
        "--junitxml=report.xml",
        "--vram-json=figures.json",
    )
    result.assert_outcomes(passed=1)
    environment = json.loads((pytester.path / "figures.json").read_text())["environments"]
    assert environment["sim"]["sim_host_tensors"] == "host"
    xml = Path(pytester.path / "report.xml").read_text()
    # The weights, their gradient, the batch, its copy, the output and the cuBLAS workspaces
    # of the forward's and autograd's threads; never the host's copies of any of them.
    weights = 4 * MiB
    batch = 4 * 1024 * 4
    peak = int(xml.split('name="vram_peak_allocated" value="')[1].split('"')[0])
    assert 2 * weights + batch <= peak <= 2 * weights + batch + 2 * 32 * MiB + 64 * 1024


def test_by_default_they_are_the_devices(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_cpu_code="""
        import torch

        def test_on_the_host(vram):
            kept = torch.zeros(1024 * 1024)  # 4 MiB, no device named
            assert torch.cuda.memory_allocated() == 4 * 2**20
        """
    )
    result = pytester.runpytest("--vram-backend=sim", "--vram-json=figures.json")
    result.assert_outcomes(passed=1)
    environment = json.loads((pytester.path / "figures.json").read_text())["environments"]
    assert environment["sim"]["sim_host_tensors"] == "device"


def test_baselines_recorded_with_the_other_setting_are_a_warning(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_host=SUITE)
    pytester.runpytest("--vram-backend=sim", "--vram-update-baselines").assert_outcomes(passed=1)
    result = pytester.runpytest("--vram-backend=sim", "--vram-sim-host-tensors=host")
    result.assert_outcomes(passed=1, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "  baselines/sim.yaml:1: VramWarning: the baselines in sim.yaml were measured in "
            "another environment (sim_host_tensors device -> host); update them with*"
        ]
    )


def test_an_unknown_setting_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nvram_sim_host_tensors = elsewhere\n")
    pytester.makepyfile(test_one="def test_one():\n    pass\n")
    result = pytester.runpytest("--vram-backend=sim")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*vram_sim_host_tensors = 'elsewhere': expected one of device, host*"]
    )


SAVED_ON_CPU = """
import torch
from torch import nn

def test_activations_on_the_host(vram):
    model = nn.Sequential(*[nn.Linear(512, 512) for _ in range(4)]).cuda()
    x = torch.randn(256, 512, device="cuda")
    with torch.no_grad():
        model(x)  # the first matrix multiply's cuBLAS workspace
    before = torch.cuda.memory_allocated()
    with torch.autograd.graph.save_on_cpu(pin_memory=True):
        loss = model(x).sum()
    # Only the loss: every activation saved for backward waits on the host.
    assert torch.cuda.memory_allocated() - before == 512
    loss.backward()
    assert model[0].weight.grad.shape == (512, 512)
"""


@pytest.mark.parametrize("compute", ["never", "always"])
def test_save_on_cpu_keeps_the_activations_off_the_device(
    pytester: pytest.Pytester, compute: str
) -> None:
    pytester.makepyfile(test_saved=SAVED_ON_CPU)
    result = pytester.runpytest(
        "--vram-backend=sim", "--vram-sim-host-tensors=host", f"--vram-sim-compute={compute}"
    )
    result.assert_outcomes(passed=1)
