"""CUDA device arguments below Python, for tests that compute on the simulated device on a build
of PyTorch without CUDA (this machine's) and do not see CUDA: the tests simulated only because
of ``--vram-gate=all`` (a test that sees CUDA runs under the function mode, which shows it
where each tensor is)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pytest_vram.backends.sim import cudaremap
from pytest_vram.backends.sim.backend import SimBackend

pytestmark = pytest.mark.skipif(
    not cudaremap.available(), reason="needs a build of PyTorch without CUDA and a compiler"
)


@contextlib.contextmanager
def computing(cuda_shown: bool = False) -> Iterator[SimBackend]:
    backend = SimBackend()
    backend.use_values(True)
    backend.show_cuda(cuda_shown)
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.end_test()


def function_modes() -> int:
    return torch._C._len_torch_function_stack()


def test_a_computing_test_runs_under_no_function_mode_with_real_values() -> None:
    with computing() as backend:
        assert function_modes() == 0
        x = torch.arange(6, device="cuda", dtype=torch.float32).reshape(2, 3)
        y = torch.tensor([[1.0], [2.0]], device="cuda")
        assert (x * y).sum().item() == 3.0 + 2 * 12.0
        assert torch.randn(4, 4, device=torch.device("cuda", 0)).std().item() > 0
        assert torch.zeros(3, device="cuda", pin_memory=True).tolist() == [0.0, 0.0, 0.0]
        # Pinned host memory needs a CUDA runtime: here it is plain memory.
        assert not torch.empty_like(x, device="cpu", pin_memory=True).is_pinned()
        assert x.new_zeros(2, pin_memory=True).tolist() == [0.0, 0.0]
        # Counted as the CUDA allocator hands them out: 512 bytes a tensor this small.
        assert backend.allocated() == 2 * 512
    assert torch.empty_like is torch._C._VariableFunctions.empty_like
    assert "new_zeros" not in torch.Tensor.__dict__


def test_moving_to_the_device_copies_only_what_was_not_on_it() -> None:
    before = torch.ones(1024)  # made before the test: host memory
    with computing() as backend:
        start = backend.allocated()
        moved = before.cuda()
        assert moved is not before and torch.equal(moved, before)
        assert backend.allocated() - start == 4096
        # Every way of naming the device copies a host tensor, counted; a dtype alone names
        # none, and what has it already is returned as it is.
        for moved in (
            before.to(0),
            before.to(torch.device("cuda")),
            before.to(device="cuda:0"),
            before.to("cuda", torch.float64),
        ):
            assert moved is not before and backend.counted(moved)
        assert before.to(torch.float32) is before
        on_device = torch.ones(1024, device="cuda")
        assert on_device.cuda() is on_device
        assert on_device.to("cuda") is on_device
        assert on_device.to("cuda", dtype=torch.float16).dtype == torch.float16
        assert on_device.pin_memory() is on_device and not on_device.is_pinned()
        model = nn.Linear(16, 16)
        weight = model.weight
        model.cuda()
        assert model.weight is weight  # PyTorch's own Module._apply: the parameter stays
        assert backend.counted(model.weight)


def test_cuda_autocast_follows_cuda_op_lists_while_computing() -> None:
    with computing():
        linear = nn.Linear(64, 64).cuda()
        x = torch.randn(8, 64, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            assert function_modes() == 1  # the function mode applies CUDA's lists inside
            y = linear(x)
            assert y.dtype == torch.bfloat16
            for fp32 in (y.softmax(-1), F.log_softmax(y, -1), y.sum(), F.mse_loss(y, y)):
                assert fp32.dtype == torch.float32
            with torch.autocast("cuda", enabled=False):
                assert linear(x).dtype == torch.float32
        assert function_modes() == 0
        with torch.autocast("cuda"):
            assert linear(x).dtype == torch.float16

        @torch.autocast("cuda", dtype=torch.bfloat16)
        def forward(t: torch.Tensor) -> torch.Tensor:
            return linear(t).softmax(-1)

        assert forward(x).dtype == torch.float32
        assert function_modes() == 0


NOT_COMPILED = "Torch not compiled with CUDA enabled"


def test_after_the_test_the_build_refuses_cuda_again() -> None:
    with computing():
        torch.ones(1, device="cuda").cuda()
        torch.tensor([1.0], device="cuda")
    assert "to" not in torch.Tensor.__dict__ and "cuda" not in torch.Tensor.__dict__
    assert torch.zeros is torch._C._VariableFunctions.zeros
    # As a build without CUDA says it, and not PyTorch's "not linked with support for cuda".
    for make in (
        lambda: torch.zeros(1, device="cuda"),
        lambda: torch.ones(1).cuda(),
        lambda: torch.ones(1).to("cuda"),
        lambda: torch.tensor([1.0], device="cuda"),
    ):
        with pytest.raises(AssertionError, match=NOT_COMPILED):
            make()


def test_an_error_in_the_test_leaves_nothing_installed() -> None:
    with pytest.raises(ValueError), computing():
        torch.ones(1, device="cuda")
        raise ValueError("the test failed")
    assert function_modes() == 0
    with pytest.raises(AssertionError, match=NOT_COMPILED):
        torch.tensor([1.0], device="cuda")


def test_a_computing_test_that_sees_cuda_runs_under_the_function_mode() -> None:
    with computing(cuda_shown=True) as backend:
        assert function_modes() == 1
        assert "to" not in torch.Tensor.__dict__  # the function mode's own Tensor.to
        x = torch.ones(1024, device="cuda")
        assert x.is_cuda and x.cuda() is x
        assert backend.allocated() == 4096


def test_on_a_build_with_cuda_faked_the_function_mode_remaps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A build with CUDA keeps its own CUDA kernels: computing falls back on the function mode.
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    assert not cudaremap.available()
    with computing() as backend:
        assert function_modes() == 1
        x = torch.ones(1024, device="cuda")
        assert x.cuda() is x
        assert backend.allocated() == 4096
