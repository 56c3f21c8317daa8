"""The simulated device's one way to patch and put back, and what goes through it."""

from __future__ import annotations

import pytest
import torch
from torch.optim import optimizer as optimizer_module

from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.sim.patches import PatchSet
from pytest_vram.backends.sim.ranks import SimulatedRanks


class Base:
    inherited = "base"


class Owner(Base):
    own = "own"


def test_a_replacement_puts_back_what_was_there() -> None:
    with PatchSet() as patches:
        patches.replace(Owner, "own", "patched")
        patches.replace(Owner, "own", "patched again")
        assert Owner.own == "patched again"
    assert Owner.__dict__["own"] == "own"


def test_only_what_exists_is_replaced() -> None:
    patches = PatchSet()
    patches.replace(Owner, "inherited", "patched")  # not the class's own
    patches.replace(Owner, "missing", "patched")
    patches.shadow(Owner, "missing", "patched")
    assert len(patches) == 0
    assert "inherited" not in Owner.__dict__ and not hasattr(Owner, "missing")


def test_a_shadowed_inherited_name_is_removed_again() -> None:
    patches = PatchSet()
    patches.shadow(Owner, "inherited", "patched")
    assert Owner.inherited == "patched" and Base.inherited == "base"
    patches.restore()
    assert "inherited" not in Owner.__dict__ and Owner.inherited == "base"


def test_restoring_twice_is_restoring_once() -> None:
    patches = PatchSet()
    patches.replace(Owner, "own", "patched")
    patches.restore()
    Owner.own = "changed since"
    try:
        patches.restore()
        assert Owner.own == "changed since"
    finally:
        Owner.own = "own"


class Guarded(type):
    def __setattr__(cls, name: str, value: object) -> None:
        if cls.__dict__.get("sealed"):
            raise AttributeError(f"{name} is read-only")
        super().__setattr__(name, value)


def test_one_patch_that_cannot_be_put_back_keeps_no_other_from_it() -> None:
    sealable = Guarded("Sealable", (), {"value": 1, "sealed": False})
    patches = PatchSet()
    patches.replace(Owner, "own", "patched")
    patches.replace(sealable, "value", 2)
    type.__setattr__(sealable, "sealed", True)
    with pytest.raises(AttributeError, match="value is read-only"):
        patches.restore()
    assert Owner.__dict__["own"] == "own"
    assert len(patches) == 0


def test_a_failing_install_leaves_torch_as_it_was() -> None:
    backend = SimBackend()
    is_available, memory_allocated = torch.cuda.is_available, torch.cuda.memory_allocated
    step_hooks = len(optimizer_module._global_optimizer_pre_hooks)

    def refuse() -> None:
        raise RuntimeError("refused")

    backend.cuda._inductor.start = refuse  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="refused"):
        backend.cuda.install()
    assert torch.cuda.is_available is is_available
    assert torch.cuda.memory_allocated is memory_allocated
    assert len(optimizer_module._global_optimizer_pre_hooks) == step_hooks
    assert not backend.cuda.installed


def test_simulated_ranks_put_back_what_they_patched() -> None:
    storage = torch.UntypedStorage
    # Inherited from the storage base, unless a tool set it on the class (torch's MemTracker).
    own_before = storage.__dict__.get("resize_")
    resize = storage.resize_
    backend = SimBackend()
    ranks = SimulatedRanks(2, backend)
    ranks.start()
    try:
        assert storage.__dict__["resize_"] is not own_before
    finally:
        ranks.stop()
    assert storage.__dict__.get("resize_") is own_before
    assert storage.resize_ is resize
