"""Foreach ops on the simulated device run once for each kind of tensor in their lists.

:func:`pytest_vram.backends.sim.foreach.by_kind` runs a ``torch._foreach_*`` op on the first
position of each kind (same shape, stride, dtype, device and scalars) and gives every other
position a new fake tensor like its kind's output. These tests run each op both ways and compare
what a program and the storage tracker can see.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch

from pytest_vram.backends.sim import foreach
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.sim.fakemode import SimFakeTensorMode
from pytest_vram.backends.tracker import StorageTracker

SHAPES = [(6, 4), (4, 6), (6,), (3, 2, 4)]


def sim_mode() -> SimFakeTensorMode:
    return SimFakeTensorMode(StorageTracker(lambda tensor: True))


@contextmanager
def every_position(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Foreach ops run on every position, as FakeTensorMode runs them."""
    with monkeypatch.context() as patch:
        patch.setattr(foreach, "kinds", lambda mode, args, kwargs: None)
        yield


def lists(dtype: torch.dtype = torch.float32) -> list[list[torch.Tensor]]:
    """Three lists of 12 tensors, of 4 kinds: the shapes repeat, one of them transposed."""
    made = []
    for _ in range(3):
        tensors = [torch.empty(SHAPES[i % 4], dtype=dtype) for i in range(12)]
        tensors[1] = torch.empty(6, 4, dtype=dtype).t()  # the same shape as (4, 6), transposed
        made.append(tensors)
    return made


def described(out: Any, inputs: list[list[torch.Tensor]]) -> Any:
    if out is None:
        return None
    storages = [t.untyped_storage()._cdata for tensors in inputs for t in tensors]
    return [
        {
            "type": type(t),
            "attributes": dict(t.__dict__),
            "shape": t.shape,
            "stride": t.stride(),
            "offset": t.storage_offset(),
            "dtype": t.dtype,
            "device": t.device,
            "requires_grad": t.requires_grad,
            "storage bytes": t.untyped_storage().nbytes(),
            "an input's storage": t.untyped_storage()._cdata in storages,
        }
        for t in out
    ]


OPS: dict[str, Callable[[list[list[torch.Tensor]]], Any]] = {
    "sqrt": lambda ls: torch._foreach_sqrt(ls[0]),
    "add lists": lambda ls: torch._foreach_add(ls[0], ls[1], alpha=2),
    "mul scalar": lambda ls: torch._foreach_mul(ls[0], 0.5),
    "div by scalars, two values": lambda ls: torch._foreach_div(ls[0], [1.0] * 6 + [2.0] * 6),
    "norm": lambda ls: torch._foreach_norm(ls[0]),
    "addcdiv_ in place": lambda ls: torch._foreach_addcdiv_(ls[0], ls[1], ls[2], [0.1] * 12),
    "lerp_ in place": lambda ls: torch._foreach_lerp_(ls[0], ls[1], 0.1),
    "a tensor beside the lists": lambda ls: torch._foreach_mul(ls[0], torch.tensor(2.0)),
}


@pytest.mark.parametrize("op", OPS.values(), ids=OPS.keys())
def test_a_foreach_op_by_kind_gives_what_every_position_gives(
    op: Callable, monkeypatch: pytest.MonkeyPatch
) -> None:
    mode = sim_mode()
    with mode:
        inputs = lists()
        by_kind = described(op(inputs), inputs)
        with every_position(monkeypatch):
            every = described(op(inputs), inputs)
    assert by_kind == every


def test_the_op_runs_on_one_position_of_each_kind(monkeypatch: pytest.MonkeyPatch) -> None:
    mode = sim_mode()
    dispatched: list[int] = []
    dispatch = mode.dispatch

    def counted(func: Any, types: Any, args: Any, kwargs: Any) -> Any:
        if foreach.is_foreach(func):
            dispatched.append(len(args[0]))
        return dispatch(func, types, args, kwargs)

    monkeypatch.setattr(mode, "dispatch", counted)
    with mode:
        inputs = lists()
        out = torch._foreach_sqrt(inputs[0])
        torch._foreach_div_(inputs[0], [1.0] * 6 + [2.0] * 6)
    # Five kinds of tensor, the transposed one apart; with two scalars, the kinds found in
    # both halves split in two.
    assert dispatched == [5, 9]
    assert len(out) == 12
    # Each output is a tensor of its own.
    assert len({t.untyped_storage()._cdata for t in out}) == 12


def test_a_foreach_op_is_run_whole_where_kinds_do_not_apply(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mode = sim_mode()
    with mode:
        few = [torch.empty(4) for _ in range(3)]
        many = [torch.empty(4) for _ in range(12)]
        distinct = [torch.empty(n + 1) for n in range(12)]
        scalars = torch.ones(12)
    assert foreach.kinds(mode, (few,), {}) is None  # too few to gain
    assert foreach.kinds(mode, (many, scalars), {}) is None  # a tensor beside the lists
    assert foreach.kinds(mode, (distinct,), {}) is None  # every position its own kind
    assert foreach.kinds(mode, (many, many[:11]), {}) is None  # lists of different lengths
    assert foreach.kinds(mode, (many, [1.0] * 12), {}) == ([0], [0] * 12)
    other = sim_mode()
    with other:
        foreign = [torch.empty(4) for _ in range(12)]
    assert foreach.kinds(mode, (foreign,), {}) is None  # another mode's tensors


def test_an_error_at_one_position_is_raised_as_torch_raises_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def add() -> None:
        left = [torch.empty(4) for _ in range(12)]
        right = [torch.empty(4) for _ in range(12)]
        right[7] = torch.empty(5)
        torch._foreach_add_(left, right)

    with sim_mode(), pytest.raises(RuntimeError) as by_kind:
        add()
    with sim_mode(), every_position(monkeypatch), pytest.raises(RuntimeError) as every:
        add()
    assert str(by_kind.value) == str(every.value)
    assert "length 5" in str(by_kind.value)


def test_an_optimizer_step_measures_the_same_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    def measured() -> tuple[int, int]:
        backend = SimBackend(workspaces=True)
        backend.use_values(False)
        backend.begin_test()
        try:
            model = torch.nn.Sequential(
                *(torch.nn.Linear(32, 32) for _ in range(6)), torch.nn.Linear(32, 8)
            ).to("cuda")
            optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
            for _ in range(2):
                model(torch.randn(16, 32, device="cuda")).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            return backend.peak_allocated(), backend.allocated()
        finally:
            backend.end_test()

    by_kind = measured()
    with every_position(monkeypatch):
        every = measured()
    assert by_kind == every
