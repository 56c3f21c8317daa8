"""Which factory calls make an optimizer's host scalars, told by torch's optimizer step hooks."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

from pytest_vram.backends.sim.hostscalars import HostScalars


class Asking(torch.optim.Optimizer):
    """An optimizer whose step asks what a step of AdamW's would make its counters with."""

    def __init__(self, params: Any, scalars: HostScalars, **defaults: Any) -> None:
        super().__init__(params, defaults)
        self.scalars = scalars
        self.answers: list[bool] = []
        self.fail = False

    def step(self, closure: Any = None) -> None:  # type: ignore[override]
        self.answers.append(self.scalars.made_by(torch.tensor, (0.0,), {"dtype": torch.float32}))
        self.answers.append(self.scalars.made_by(torch.zeros, (), {"device": "cuda"}))
        if self.fail:
            raise RuntimeError("the step failed")


@pytest.fixture
def scalars() -> Iterator[HostScalars]:
    scalars = HostScalars()
    scalars.start()
    yield scalars
    scalars.stop()


def _params() -> list[nn.Parameter]:
    return [nn.Parameter(torch.zeros(2))]


def test_a_steps_own_scalars_are_host_memory(scalars: HostScalars) -> None:
    optimizer = Asking(_params(), scalars)
    optimizer.step()
    # Made with no device inside the step: host memory; on the device: not.
    assert optimizer.answers == [True, False]
    assert not scalars.made_by(torch.tensor, (0.0,), {})  # outside any step


@pytest.mark.parametrize("option", ["capturable", "fused"])
def test_capturable_and_fused_steps_keep_them_on_the_device(
    scalars: HostScalars, option: str
) -> None:
    optimizer = Asking(_params(), scalars, **{option: True})
    optimizer.step()
    assert optimizer.answers == [False, False]


def test_copying_a_tensor_is_not_making_a_scalar(scalars: HostScalars) -> None:
    seen: list[bool] = []

    def ask(optimizer: Any, args: Any, kwargs: Any) -> None:
        seen.append(scalars.made_by(torch.tensor, (torch.ones(1),), {}))

    optimizer = Asking(_params(), scalars)
    handle = optimizer.register_step_pre_hook(ask)
    try:
        optimizer.step()
    finally:
        handle.remove()
    assert seen == [False]


def test_a_failed_step_ends_with_the_next_one(scalars: HostScalars) -> None:
    optimizer = Asking(_params(), scalars)
    optimizer.fail = True
    with pytest.raises(RuntimeError, match="the step failed"):
        optimizer.step()
    optimizer.fail = False
    optimizer.step()
    assert scalars.stepping_optimizer() is None


def test_stopped_it_hears_of_no_step() -> None:
    scalars = HostScalars()
    scalars.start()
    scalars.stop()
    optimizer = Asking(_params(), scalars)
    optimizer.step()
    assert optimizer.answers == [False, False]
