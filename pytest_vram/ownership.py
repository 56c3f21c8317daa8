"""Which memory is a test's own, so that its figures do not depend on what ran before it.

A test owns what its fixtures hold, of any scope, and what it allocates itself. Memory that
other tests' fixtures hold, or that earlier tests left behind, is not its own. The figures are
therefore read as ``held + (allocated now - allocated at the start)``, where ``held`` is what
the test's fixtures that already existed when it started (a module- or session-scoped fixture
an earlier test made) hold on the measured device. A broader-scoped fixture made in this test's
own setup counts with what it holds once made, not with the temporaries of making it, which a
later test would not see either.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_vram.backends import Backend

__all__ = ["OwnView", "held_by_fixtures", "tensors_in"]

# How many objects one fixture value's walk visits at most: a fixture that holds a whole
# framework's state is not walked to its end.
_WALK_LIMIT = 200_000
_SKIPPED_TYPES = (
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    type,
    str,
    bytes,
    bytearray,
    int,
    float,
    complex,
    bool,
    type(None),
)


def tensors_in(value: Any) -> Iterator[Any]:
    """The tensors ``value`` holds: itself, its items, a module's parameters, buffers and
    attributes, an optimizer's state, an object's attributes, and each tensor's ``.grad``."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    tensor_type = torch.Tensor
    seen: set[int] = set()
    pending = [value]
    while pending and len(seen) < _WALK_LIMIT:
        obj = pending.pop()
        if id(obj) in seen or isinstance(obj, _SKIPPED_TYPES):
            continue
        seen.add(id(obj))
        if isinstance(obj, tensor_type):
            yield obj
            grad = obj.grad if obj.is_leaf else None  # a non-leaf's .grad warns
            if grad is not None:
                pending.append(grad)
            continue
        if isinstance(obj, dict):
            pending.extend(obj.values())
            pending.extend(key for key in obj if isinstance(key, tensor_type))
        elif isinstance(obj, (list, tuple, set, frozenset)):
            pending.extend(obj)
        else:
            attributes = getattr(obj, "__dict__", None)
            if isinstance(attributes, dict):
                pending.append(attributes)
            for slot in getattr(type(obj), "__slots__", ()):
                if isinstance(slot, str) and hasattr(obj, slot):
                    pending.append(getattr(obj, slot))


def held_bytes(values: list[Any], backend: Backend) -> int:
    """The bytes ``backend`` counts for the storages ``values`` hold, each storage once."""
    storages: dict[Any, int] = {}
    for value in values:
        for tensor in tensors_in(value):
            try:
                size = backend.storage_bytes(tensor)
                key = tensor.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError, AttributeError, TypeError):
                continue  # a wrapper subclass without a storage of its own
            if size is not None:
                storages[key] = size
    return sum(storages.values())


def cached_fixture_values(item: pytest.Item) -> list[Any]:
    """The values of ``item``'s fixtures that an earlier test made and this one will reuse:
    broader-scoped fixtures whose cached value has this test's parameter."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    callspec = getattr(item, "callspec", None)
    params = getattr(callspec, "params", {})
    values = []
    for name in item.fixturenames:  # type: ignore[attr-defined]
        definitions = info.name2fixturedefs.get(name)
        if not definitions:
            continue
        definition = definitions[-1]
        cached = getattr(definition, "cached_result", None)
        if cached is None or cached[0] is None:
            continue
        if name in params:
            # pytest keys a parametrized fixture's cached value by the parameter it was made
            # with, and makes it anew for another.
            key = params[name]
            try:
                reused = bool(cached[1] == key) or cached[1] is key
            except Exception:  # a parameter whose == does not answer a bool
                reused = cached[1] is key
        else:
            reused = True
        if reused:
            values.append(cached[0])
    return values


def held_by_fixtures(item: pytest.Item, backend: Backend) -> int:
    """What ``item``'s already made fixtures hold on ``backend``'s device, in bytes."""
    return held_bytes(cached_fixture_values(item), backend)


class OwnView:
    """A backend as one test sees it: allocated and peak bytes are the test's own.

    It passes everything else to the backend. ``begin_test`` fixes the offset: what was
    allocated then, less what the test's fixtures already held.
    """

    def __init__(self, backend: Backend, held: int) -> None:
        self._backend = backend
        self.held = held
        self._offset = 0
        self._excluding = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def begin_test(self) -> None:
        self._backend.begin_test()
        self._offset = self._backend.allocated() - self.held

    def allocated(self) -> int:
        return max(0, self._backend.allocated() - self._offset)

    def peak_allocated(self) -> int:
        return max(0, self._backend.peak_allocated() - self._offset)

    def enter_excluded(self, fold: Any) -> None:
        """A broader-scoped fixture starts being made: ``fold()`` keeps the peaks so far."""
        if self._excluding == 0:
            fold()
        self._excluding += 1

    def exit_excluded(self) -> None:
        """It is made: what making it cost above what it holds is forgotten."""
        self._excluding -= 1
        if self._excluding == 0:
            self._backend.reset_peak()
