"""Where a tensor is, as a test's code sees it on the simulated device: ``cuda:0`` for what is on
the device, ``cpu`` for the host, shape-only and computing, as on a GPU, whether the device
counts host tensors (``--vram-sim-host-tensors=device``, the default) or not (``host``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from simulated_device import simulated
from torch import nn

from pytest_vram.backends.sim.backend import SimBackend

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")


SETTINGS = ["device", "host"]


@pytest.fixture(params=SETTINGS)
def host_tensors(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=[False, True], ids=["shape-only", "computing"])
def sim(request: pytest.FixtureRequest, host_tensors: str) -> Iterator[SimBackend]:
    with simulated(request.param, host_tensors=host_tensors) as backend:
        yield backend


def test_a_tensor_on_the_device_answers_cuda(sim: SimBackend) -> None:
    x = torch.ones(4, device="cuda")
    assert (x.device, x.is_cuda, x.get_device()) == (CUDA, True, 0)
    assert (x * 2).device == CUDA  # what is computed from it too
    assert torch.zeros(4, device=x.device).device == CUDA
    host = torch.ones(4)
    assert (host.device, host.is_cuda, host.get_device()) == (CPU, False, -1)
    assert (host + 1).device == CPU
    assert "device='cuda:0'" in repr(torch.zeros(2, device="cuda"))


def test_a_module_moved_to_cuda_has_its_parameters_there(sim: SimBackend) -> None:
    model = nn.Linear(8, 8)
    assert next(model.parameters()).device == CPU
    model.to("cuda")
    assert {p.device for p in model.parameters()} == {CUDA}
    out = model(torch.ones(2, 8).cuda())
    assert out.device == CUDA
    out.sum().backward()
    assert model.weight.grad.device == CUDA
    model.cpu()
    assert {p.device for p in model.parameters()} == {CPU}


def test_moving_back_to_the_host_makes_a_host_copy(sim: SimBackend) -> None:
    x = torch.ones(1024, device="cuda")
    counted = sim.allocated()
    for back in (x.cpu(), x.to("cpu"), x.to(torch.ones(1)), x.to(device="cpu")):
        assert back.device == CPU and back is not x
    assert sim.allocated() == counted  # the host copies are not the device's
    assert x.device == CUDA  # and the tensor itself stays where it was


def test_a_host_tensor_moved_to_the_device_hands_it_its_count(sim: SimBackend) -> None:
    host = torch.ones(1024)
    counted = sim.allocated()
    moved = host.cuda()
    assert moved.is_cuda and not host.is_cuda
    # By default the host tensor was the device's and its copy takes its place; with host
    # tensors kept on the host only the copy is.
    assert sim.allocated() - counted == (4096 if not sim.host.counts_host else 0)
    rows = torch.ones(64, 64)  # a part of a host tensor moves as a copy of its own
    before = sim.allocated()
    part = rows[:16].to("cuda")
    assert part.is_cuda and sim.allocated() - before == 16 * 64 * 4
    del moved, part


def test_device_comparisons_follow_the_devices(sim: SimBackend) -> None:
    x = torch.ones(3, device="cuda")
    assert x.device == torch.device("cuda") or x.device == torch.device("cuda:0")
    assert x.device.type == "cuda" and x.device.index == 0
    assert x.to(torch.float16).device == CUDA
    assert torch.ones(3).to(x).device == CUDA  # x.to(other): other's device
    with torch.device("cuda"):
        assert torch.zeros(2).device == CUDA


def test_a_computed_result_compares_with_the_hosts_expectation(host_tensors: str) -> None:
    with simulated(True, host_tensors=host_tensors):
        expected = torch.arange(4.0) * 2  # on the host
        out = (torch.arange(4.0, device="cuda") * 2).cpu()
        torch.testing.assert_close(out, expected)
        with pytest.raises(AssertionError, match="device"):  # as on a GPU
            torch.testing.assert_close(out.cuda(), expected)


def test_histc_of_integers_counts_as_on_cuda(sim: SimBackend) -> None:
    # CUDA's kernel takes integers, the CPU's refuses them; code that sees its tensor on cuda
    # passes them (transformers' MoE layers).
    ids = torch.tensor([0, 1, 1, 3], dtype=torch.int32, device="cuda")
    before = sim.allocated()
    counts = torch.histc(ids, bins=4, min=0, max=3)
    assert (counts.dtype, counts.shape, counts.device) == (torch.int32, (4,), CUDA)
    assert ids.histc(bins=4, min=0, max=3).dtype == torch.int32
    assert sim.allocated() - before == 512  # the result alone: the float32 scratch is the host's
    if sim.computing:
        assert counts.tolist() == [1, 2, 0, 1]


def test_a_compiled_model_is_one_graph_on_the_device(sim: SimBackend) -> None:
    import torch._dynamo.testing

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).cuda()
    counter = torch._dynamo.testing.CompileCounter()
    out = torch.compile(model, backend=counter)(torch.ones(4, 64, device="cuda"))
    # Dynamo compiles on the tensors' own devices, and the graph's outputs are the device's.
    assert (counter.frame_count, out.device) == (1, CUDA)
    assert torch.compile(torch.sin)(torch.ones(8, device="cuda")).cpu().device == CPU


CAUSE = """
import pytest
import torch
from torch import nn

pytestmark = pytest.mark.max_vram("1GiB")

def test_where_the_tensors_are():
    assert torch.cuda.is_available()
    model = nn.Linear(64, 64).to("cuda")
    x = torch.randn(8, 64, device="cuda")
    assert next(model.parameters()).device == torch.device("cuda:0")
    out = model(x)
    assert out.is_cuda and out.get_device() == 0
    assert out.device.type == "cuda"
    assert not out.cpu().is_cuda

def test_values_against_the_host():
    x = torch.arange(6.0).reshape(2, 3)
    y = (x.cuda() * 3).cpu()
    assert y.device.type == "cpu"
    torch.testing.assert_close(y, x * 3)
    assert y.sum().item() == 45.0

def test_a_parameter_check_before_a_forward():
    model = nn.Linear(4, 4).cuda()
    # As DataParallel checks its module before it scatters the inputs.
    source = torch.device("cuda", torch.cuda.current_device())
    assert all(t.device == source for t in model.parameters())
"""


@pytest.mark.parametrize("compute", ["auto", "always"])
def test_an_opted_in_test_that_checks_its_devices_passes(
    pytester: pytest.Pytester, compute: str, host_tensors: str
) -> None:
    pytester.makepyfile(test_cause=CAUSE)
    result = pytester.runpytest(
        "--vram-backend=sim",
        f"--vram-sim-host-tensors={host_tensors}",
        f"--vram-sim-compute={compute}",
        "-p",
        "no:randomly",
    )
    result.assert_outcomes(passed=3)
    assert "passes without the simulated device" not in result.stdout.str()
