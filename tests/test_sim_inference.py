"""Under ``torch.inference_mode()`` the simulated device makes the requests a GPU makes: a
composite op such as ``matmul`` or ``einsum`` runs as its parts (its copies, its matrix
product, the cuBLAS workspace), as in grad mode and under ``torch.no_grad()``."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager

import pytest
import torch

from pytest_vram.backends.sim.backend import SimBackend

MiB = 1 << 20
HOPPER_WORKSPACE = 32 * MiB

Modes = Callable[[], AbstractContextManager[object]]
MODES: dict[str, Modes] = {
    "grad": torch.enable_grad,
    "no_grad": torch.no_grad,
    "inference_mode": torch.inference_mode,
}


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimBackend]:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    backend = SimBackend(workspaces=True)
    backend.release_cache()
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.end_test()


def requests(sim: SimBackend, mode: Modes, step: Callable[[], object]) -> list[int]:
    """The sizes of the blocks ``step`` asks for under ``mode``, in order, as
    ``torch.cuda.memory``'s history records them."""
    sim.release_cache()
    sim.workspaces.clear()
    torch.cuda.memory._record_memory_history()
    try:
        with mode():
            step()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return [event["size"] for event in trace if event["action"] == "alloc"]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_matrix_product_allocates_a_workspace_in_every_mode(sim: SimBackend, mode: str) -> None:
    a = torch.randn(64, 64, device="cuda")
    before = sim.allocated()
    with MODES[mode]():
        b = a @ a
    assert b.is_inference() == (mode == "inference_mode")
    assert len(sim.workspaces.held()) == 1
    assert sim.allocated() == before + b.untyped_storage().nbytes() + HOPPER_WORKSPACE


def test_an_einsum_makes_its_copies_and_product_under_inference_mode(sim: SimBackend) -> None:
    # Attention scores as a Transformer computes them: both operands are copied into the
    # layout bmm takes, then multiplied.
    q = torch.randn(2, 32, 4, 16, device="cuda")
    k = torch.randn(2, 32, 4, 16, device="cuda")

    def scores() -> object:
        return torch.einsum("bshd,bthd->bhst", q, k)

    operand = q.untyped_storage().nbytes()
    product = 2 * 4 * 32 * 32 * 4
    expected = [operand, operand, product, HOPPER_WORKSPACE]
    assert requests(sim, torch.inference_mode, scores) == expected
    assert requests(sim, torch.no_grad, scores) == expected


def test_an_inference_forward_makes_the_requests_of_a_no_grad_one(sim: SimBackend) -> None:
    # A pre-norm attention block written as the CS336 Transformer writes it, with einsums.
    torch.manual_seed(0)
    d, heads = 64, 4
    norm = torch.nn.LayerNorm(d).to("cuda")
    qkv = torch.nn.Linear(d, 3 * d, bias=False).to("cuda")
    out = torch.nn.Linear(d, d, bias=False).to("cuda")
    x = torch.randn(4, 32, d, device="cuda")

    def forward() -> object:
        q, k, v = qkv(norm(x)).view(4, 32, 3, heads, d // heads).unbind(2)
        scores = torch.einsum("bshd,bthd->bhst", q, k) / (d // heads) ** 0.5
        mixed = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)
        return x + out(mixed.reshape(4, 32, d))

    in_inference = requests(sim, torch.inference_mode, forward)
    assert in_inference == requests(sim, torch.no_grad, forward)
    assert in_inference == requests(sim, torch.enable_grad, forward)
    assert HOPPER_WORKSPACE in in_inference
