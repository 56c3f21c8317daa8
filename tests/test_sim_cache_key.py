"""The simulated device's FakeTensorMode makes the dispatch cache's key as FakeTensorMode does.

``SimFakeTensorMode._prep_args_for_hash`` writes a dense fake tensor's metadata into the key
itself, the same items in the same order as ``FakeTensorMode``, without building a
``TensorMetadata`` for each tensor; what it does not handle it leaves to ``FakeTensorMode``.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
from torch._subclasses import fake_tensor
from torch._subclasses.fake_tensor import FakeTensorMode, _BypassDispatchCache, _CacheKeyState

from pytest_vram.backends.sim.fakemode import SimFakeTensorMode
from pytest_vram.backends.tracker import StorageTracker

#: Whether this torch flattens the key as the sim does. Torch 2.6's method takes no list of
#: objects hashed by id and writes no list's type and length: there the sim leaves it to torch.
WRITTEN_HERE = (
    "id_hashed_objects" in inspect.signature(FakeTensorMode._prep_args_for_hash).parameters
)


def sim_mode() -> SimFakeTensorMode:
    return SimFakeTensorMode(StorageTracker(lambda tensor: True))


def key_items(mode: FakeTensorMode, args: Any, made_by: type[FakeTensorMode]) -> list[object]:
    items: list[object] = []
    id_hashed: tuple[list[object], ...] = ([],) if WRITTEN_HERE else ()
    made_by._prep_args_for_hash(mode, items, args, _CacheKeyState(None), *id_hashed)
    return items


def tensors(mode: SimFakeTensorMode) -> list[torch.Tensor]:
    """Fake tensors of every kind of metadata the key holds."""
    with mode:
        a = torch.empty(2, 3, 4, 5)
        made = [
            a,
            a.transpose(0, 1),
            a[1:],
            a.view(-1)[5:],
            a.to(memory_format=torch.channels_last),
            a.permute(0, 2, 3, 1),
            torch.empty(4, 1, 1, 1).to(memory_format=torch.channels_last),
            torch.empty(2, 3, 4, 5, 6).to(memory_format=torch.channels_last_3d),
            torch.empty(()),
            torch.empty(0, 3),
            torch.empty(3).expand(4, 3),
            torch.empty(3, dtype=torch.bool),
            torch.empty(2, 3, dtype=torch.bfloat16, requires_grad=True),
            torch.empty(3, 4, dtype=torch.complex64).conj(),
            torch.empty(3, 4, dtype=torch.complex64).conj().imag.neg(),
            torch.empty(*[1] * 70),
        ]
        with torch.inference_mode():
            made.append(torch.empty(3))
    return made


ARGUMENTS = {
    "tensors": lambda ts: tuple(ts),
    "scalars": lambda ts: (1, 2.0, True, None, "mean", torch.float16, torch.device("cuda", 0)),
    "formats": lambda ts: [ts[0], torch.contiguous_format, torch.strided],
    "nested": lambda ts: (ts[0], [1, 2, (3, ts[1])], {"alpha": ts[2], "dim": [0, 1]}),
    "kwargs": lambda ts: {"out": [ts[3], ts[4]], "keepdim": False},
    "long list": lambda ts: [ts[0]] * 70,
}


@pytest.mark.parametrize("arguments", ARGUMENTS.values(), ids=ARGUMENTS.keys())
def test_the_key_holds_what_fake_tensor_mode_puts_in_it(arguments: Any) -> None:
    mode = sim_mode()
    args = arguments(tensors(mode))
    ours = key_items(mode, args, SimFakeTensorMode)
    theirs = key_items(mode, args, FakeTensorMode)
    # Equal and of the same types: 1 and 1.0 are equal, and make tensors of other dtypes.
    assert ours == theirs
    assert [type(item) for item in ours] == [type(item) for item in theirs]


def test_a_dense_fake_tensor_argument_builds_no_tensor_metadata(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mode = sim_mode()
    args = tuple(tensors(mode))

    def refuse(tensor: torch.Tensor) -> None:
        raise AssertionError("built a TensorMetadata")

    monkeypatch.setattr(fake_tensor, "extract_tensor_metadata", refuse)
    if WRITTEN_HERE:
        assert key_items(mode, args, SimFakeTensorMode)
    else:  # torch's own method runs, and builds them
        with pytest.raises(AssertionError, match="built a TensorMetadata"):
            key_items(mode, args, SimFakeTensorMode)


def test_what_fake_tensor_mode_does_not_cache_is_still_not_cached() -> None:
    mode = sim_mode()
    with mode:
        constant = torch.empty(3, dtype=torch.long)
    constant.constant = torch.tensor([1, 2, 3])  # a fake tensor that carries its values
    other = FakeTensorMode()
    with other:
        foreign = torch.empty(3)
    for arg in (constant, foreign, torch.ones(3)):
        for made_by in (SimFakeTensorMode, FakeTensorMode):
            with pytest.raises(_BypassDispatchCache):
                key_items(mode, (arg,), made_by)


def test_ops_on_the_simulated_device_hit_the_cache() -> None:
    mode = sim_mode()
    with mode:
        a = torch.empty(64, 32)
        b = torch.empty(32, 16)
        a @ b
        hits = FakeTensorMode.cache_hits
        out = a @ b
    assert FakeTensorMode.cache_hits == hits + 1
    assert out.shape == (64, 16)


def test_the_key_is_written_here_only_where_torch_writes_it_alike(monkeypatch) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from pytest_vram.backends.sim import fakemode

    assert fakemode._writes_the_key_as_torch_does() is WRITTEN_HERE  # True on the CI's torch
    # Elsewhere the sim's method is torch's own.
    assert ("_prep_args_for_hash" in vars(fakemode.SimFakeTensorMode)) is WRITTEN_HERE

    def older(self, args):  # torch before 2.6 returned the flattened arguments
        return args

    monkeypatch.setattr(FakeTensorMode, "_prep_args_for_hash", older)
    assert not fakemode._writes_the_key_as_torch_does()


def test_an_op_on_another_subclass_goes_to_it_without_a_cache_key() -> None:
    """An op whose arguments are another subclass's tensors (a DTensor, here TwoTensor) is
    handed to that subclass as FakeTensorMode hands it, before any cache key is tried; the
    subclass brings the op back with fake tensors, which are counted."""
    from torch.testing._internal.two_tensor import TwoTensor

    observed: list[int] = []
    tracker = StorageTracker(lambda tensor: True)
    tracker.observe_output = lambda func, out: observed.append(out.untyped_storage().nbytes())
    mode = SimFakeTensorMode(tracker)
    with mode:
        pair = TwoTensor(torch.empty(8, 4), torch.empty(8, 4))
        before = dict(FakeTensorMode.cache_bypasses)
        observed.clear()
        doubled = pair * 2
    assert isinstance(doubled, TwoTensor)
    assert isinstance(doubled.a, fake_tensor.FakeTensor) and doubled.a.shape == (8, 4)
    # Each half's product came back through the mode and was counted, 8 x 4 x 4 bytes.
    assert observed == [128, 128]
    # No cache key was tried on the pair: FakeTensorMode notes one bypass for each attempt.
    assert FakeTensorMode.cache_bypasses == before
