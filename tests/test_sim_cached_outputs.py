"""The simulated device's FakeTensorMode makes a cached op's outputs as FakeTensorMode does.

For an op whose outputs its dispatch cache knows, ``SimFakeTensorMode`` wraps a meta tensor of
the cached shape (on the viewed input's storage for a view op) without FakeTensor's general
constructor (:class:`~pytest_vram.backends.sim.fakemode.FreshFakes`). These tests make each
output both ways and compare everything a program or the storage tracker can see.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch._subclasses.fake_tensor import (
    FakeTensor,
    FakeTensorConfig,
    FakeTensorMode,
    _DispatchCacheEntryOutputInfo,
)

from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.sim.fakemode import FreshFakes, SimFakeTensorMode
from pytest_vram.backends.tracker import StorageTracker

#: Whether this torch's fake tensors keep their device where the sim writes it, behind the
#: ``fake_device`` property; torch 2.6's keep it in a plain attribute, and there every fake
#: tensor comes from FakeTensor's constructor.
MADE_HERE = isinstance(vars(FakeTensor).get("fake_device"), property)
#: Whether this torch's cache entries are the ones the sim reads; torch 2.6's hold no constant
#: output value, and there torch's own method reads them.
READ_HERE = "constant_value" in {
    field.name for field in dataclasses.fields(_DispatchCacheEntryOutputInfo)
}


def sim_mode() -> SimFakeTensorMode:
    return SimFakeTensorMode(StorageTracker(lambda tensor: True))


def by_constructor(mode: SimFakeTensorMode) -> None:
    """Make the mode's cached outputs with FakeTensor's own constructor from now on."""
    mode.fresh_fakes.state = None
    mode.fresh_fakes.clear()


def inputs() -> dict[str, torch.Tensor]:
    return {
        "a": torch.empty(4, 6, 8),
        "b": torch.empty(8, 5, dtype=torch.bfloat16),
        "w": torch.empty(6, 8, requires_grad=True),
        "c": torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "s": torch.empty(()),
    }


OPS: dict[str, Callable[[dict[str, torch.Tensor]], Any]] = {
    "add": lambda t: t["a"] + 1,
    "matmul, another dtype": lambda t: t["a"].to(torch.bfloat16) @ t["b"],
    "needs grad": lambda t: t["w"] * 2,
    "channels last": lambda t: t["c"] * 3,
    "a scalar": lambda t: t["s"] + t["s"],
    "reduction": lambda t: t["a"].sum(dim=1),
    "tuple of tensors": lambda t: t["a"].max(dim=2),
    "transpose (a view)": lambda t: t["a"].transpose(0, 2),
    "slice (a view with an offset)": lambda t: t["a"][1:, 2:],
    "view of a grad leaf": lambda t: t["w"].view(-1),
    "split (a tuple of views)": lambda t: t["a"].split(3, dim=1),
    "unbind": lambda t: t["a"].unbind(0),
    "expand": lambda t: t["s"].expand(3, 4),
    "in place": lambda t: t["a"].add_(1),
}


def outputs(op: Callable, made: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    out = op(made)
    return [out] if isinstance(out, torch.Tensor) else list(out)


def described(tensor: torch.Tensor, made: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What a program, autograd or the storage tracker can see of a fake tensor."""
    storage = tensor.untyped_storage()
    return {
        "type": type(tensor),
        "attributes": dict(tensor.__dict__),
        "device": tensor.device,
        "shape": tensor.shape,
        "stride": tensor.stride(),
        "offset": tensor.storage_offset(),
        "dtype": tensor.dtype,
        "requires_grad": tensor.requires_grad,
        "leaf": tensor.is_leaf,
        "inference": tensor.is_inference(),
        "contiguous": tensor.is_contiguous(),
        "channels last": tensor.is_contiguous(memory_format=torch.channels_last),
        # As a number: torch 2.6's key sets have no ``==`` of their own.
        "dispatch keys": torch._C._dispatch_keys(tensor).raw_repr(),
        "storage bytes": storage.nbytes(),
        "shares storage with": sorted(
            name for name, other in made.items() if other.untyped_storage()._cdata == storage._cdata
        ),
    }


@pytest.mark.parametrize("op", OPS.values(), ids=OPS.keys())
def test_a_cached_output_is_the_one_fake_tensor_modes_constructor_makes(op: Callable) -> None:
    mode = sim_mode()
    # Made here only where this torch keeps the fake device where the sim writes it.
    assert (mode.fresh_fakes.state is not None) is MADE_HERE
    with mode:
        made = inputs()
        outputs(op, made)  # the first call fills the cache
        here = [described(out, made) for out in outputs(op, made)]
        by_constructor(mode)
        theirs = [described(out, made) for out in outputs(op, made)]
    assert here == theirs


def test_cached_outputs_are_made_here_for_plain_outputs_and_views(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    made_here = []
    make = FreshFakes.make

    def counted(self: FreshFakes, meta: torch.Tensor, device: torch.device) -> FakeTensor:
        made_here.append(meta.shape)
        return make(self, meta, device)

    monkeypatch.setattr(FreshFakes, "make", counted)
    mode = sim_mode()
    with mode:
        a = torch.empty(4, 6)
        a * 2, a.t()  # into the cache, which every mode in the process shares
        made_here.clear()
        hits = FakeTensorMode.cache_hits
        a * 2, a.t()
    assert FakeTensorMode.cache_hits == hits + 2
    # From the cache: the product and the view are made here, or by torch where it differs.
    assert made_here == ([(4, 6), (6, 4)] if MADE_HERE and READ_HERE else [])


def test_a_training_step_measures_the_same_either_way() -> None:
    def peak(constructor: bool) -> tuple[int, int]:
        torch.manual_seed(0)
        backend = SimBackend(workspaces=True)
        backend.use_values(False)
        backend.begin_test()
        try:
            if constructor:
                by_constructor(backend.fake_mode)
            model = torch.nn.Sequential(
                torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)
            ).to("cuda")
            optimizer = torch.optim.AdamW(model.parameters())
            for _ in range(2):
                x = torch.randn(32, 64, device="cuda")
                model(x).square().mean().backward()
                optimizer.step()
                optimizer.zero_grad()
            return backend.peak_allocated(), backend.allocated()
        finally:
            backend.end_test()

    assert peak(constructor=False) == peak(constructor=True)


def test_where_the_constructor_differs_its_own_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    # A torch whose FakeTensor carries one more attribute than the tensors made here.
    new = FakeTensor.__new__

    def with_more(cls, *args: Any, **kwargs: Any) -> FakeTensor:
        fake = new(cls, *args, **kwargs)
        fake.extra = "set by this torch"
        return fake

    monkeypatch.setattr(FakeTensor, "__new__", staticmethod(with_more))
    mode = sim_mode()
    assert mode.fresh_fakes.state is None
    with mode:
        a = torch.empty(4, 6)
        for _ in range(2):
            doubled = a * 2
    assert doubled.extra == "set by this torch"
    # Asked for the output's device where the sim reads the cache entry, and refused.
    assert dict(mode.fresh_fakes) == ({torch.device("cpu"): None} if READ_HERE else {})


def test_while_fake_tensors_are_debugged_the_constructor_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(FakeTensorConfig, "debug", True)
    assert sim_mode().fresh_fakes.state is None


def test_devices_the_constructor_would_change_are_left_to_it() -> None:
    fresh = sim_mode().fresh_fakes
    if MADE_HERE:
        assert fresh[torch.device("cpu")] == torch.device("cpu")
        assert fresh[torch.device("meta")] == torch.device("meta")
    else:  # nothing is made here: every device is left to the constructor
        assert fresh[torch.device("cpu")] is None
        assert fresh[torch.device("meta")] is None
    # An unindexed GPU device gets the current device's index.
    assert fresh[torch.device("cuda")] is None


def test_meta_outputs_are_left_to_the_constructor_where_the_mode_refuses_meta() -> None:
    mode = sim_mode()
    mode.allow_meta = False
    assert mode.fresh_fakes[torch.device("meta")] is None


def test_a_meta_output_is_the_one_the_constructor_makes() -> None:
    # A model built on the meta device is sharded there: its fake tensors' device is meta.
    mode = sim_mode()
    with mode:
        made = {"m": torch.empty(4, 6, device="meta"), "w": torch.empty(4, 6, device="meta")}
        for _ in range(2):
            here = [described(out, made) for out in (made["m"] * 2, made["w"].t())]
        by_constructor(mode)
        theirs = [described(out, made) for out in (made["m"] * 2, made["w"].t())]
    assert here == theirs
    assert here[0]["device"] == torch.device("meta")


def test_an_unsafe_view_is_a_view_below_autograd_and_not_above_it() -> None:
    """``_unsafe_view`` (a matmul's output reshaped) runs as ``view``, whose outputs the cache
    knows: the same tensor as FakeTensorMode's own, on the input's storage; autograd, above,
    still sees no view."""

    def made(mode: FakeTensorMode) -> tuple[dict[str, Any], dict[str, Any]]:
        with mode:
            inputs = {"a": torch.empty(4, 6, 8, requires_grad=True), "b": torch.empty(8, 5)}
            flat = torch.ops.aten._unsafe_view(inputs["a"].detach(), [24, 8])
            product = inputs["a"] @ inputs["b"]  # reshaped with _unsafe_view inside matmul
            seen = {"flat": flat, "product": product}
            return (
                {name: described(t, {**inputs, **seen}) for name, t in seen.items()},
                {"product's base": product._base, "grad_fn": type(product.grad_fn).__name__},
            )

    ours, ours_above = made(sim_mode())
    theirs, theirs_above = made(FakeTensorMode(allow_non_fake_inputs=True))
    for figures in (*ours.values(), *theirs.values()):
        del figures["attributes"]  # the modes differ, and so their tensors' fake_mode
    assert ours == theirs
    assert ours["flat"]["shares storage with"] == ["a", "flat"]  # a view of a below autograd
    assert ours_above == theirs_above == {"product's base": None, "grad_fn": "UnsafeViewBackward0"}


VALUES = {
    "a float": lambda: torch.tensor(0.0),
    "an int": lambda: torch.tensor(3),
    "a float64 in a list": lambda: torch.tensor([1.5], dtype=torch.float64),
    "a bool": lambda: torch.tensor(True),
    "two values (no constant)": lambda: torch.tensor([1.0, 2.0]),
}


@pytest.mark.parametrize("make", VALUES.values(), ids=VALUES.keys())
def test_a_small_host_tensor_is_the_constant_fake_tensor_mode_makes(make: Callable) -> None:
    """``torch.tensor(...)`` (an optimizer's step counter) lifted into the simulation: the same
    fake tensor as FakeTensorMode's own, its constant a copy of the value; an op that writes
    the constant in place returns that same fake tensor."""

    def lifted(mode: FakeTensorMode) -> dict[str, Any]:
        with mode:
            value = make()
            figures = described(value, {"value": value})
            del figures["attributes"]
            constant = value.constant
            figures["constant"] = None if constant is None else (constant.tolist(), constant.dtype)
            if constant is not None:
                # What FakeTensorMode makes of the constant, as an op on it returns it, is this.
                converter = mode.fake_tensor_converter
                figures["its fake"] = converter.from_real_tensor(mode, constant) is value
                figures["in place returns it"] = value.zero_() is value
                figures["after"] = value.constant.tolist()
            figures["attribute names"] = sorted(value.__dict__)
            return figures

    ours = lifted(sim_mode())
    theirs = lifted(FakeTensorMode(allow_non_fake_inputs=True))
    ours["attribute names"].remove("_pytest_vram_known")  # the sim's known values
    assert ours == theirs


def test_outputs_are_made_here_only_where_torch_reads_cache_entries_alike(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from pytest_vram.backends.sim import fakemode

    assert fakemode._reads_cache_entries_as_torch_does() is READ_HERE  # True on the CI's torch
    # Elsewhere the sim's method is torch's own.
    method = "_get_output_tensor_from_cache_entry"
    assert (method in vars(fakemode.SimFakeTensorMode)) is READ_HERE

    def older(self, state, entry, key, func, args, kwargs):  # another signature
        return None

    monkeypatch.setattr(FakeTensorMode, "_get_output_tensor_from_cache_entry", older)
    assert not fakemode._reads_cache_entries_as_torch_does()
    monkeypatch.delattr(FakeTensorMode, "_get_output_tensor_from_cache_entry")
    assert not fakemode._reads_cache_entries_as_torch_does()  # a torch without the method
