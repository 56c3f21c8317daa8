"""Which memory is a test's own, so that its figures do not depend on what ran before it.

A test owns what its fixtures hold, of any scope, and what it allocates itself. Memory that
other tests' fixtures hold, or that earlier tests left behind, is not its own. The figures are
therefore read as ``held + (allocated now - allocated at the start)``, where ``held`` is what
the test's fixtures that already existed when it started (a module- or session-scoped fixture
an earlier test made) hold on the measured device. A broader-scoped fixture made in this test's
own setup counts with what it holds once made, not with the temporaries of making it, which a
later test would not see either.

Reserved memory cannot be read so: whether a test's allocations need a new segment depends on
the segments everything else alive keeps. The simulated device lays out the test's own memory
on segments of its own instead (see ``OwnSegments``); the cuda backend's reserved figures are the
real allocator's, the whole process's.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Iterator
from typing import Any

import pytest

from pytest_vram.backends import Backend

__all__ = [
    "OwnView",
    "broader_scoped",
    "held_bytes",
    "held_storages",
    "still_held_by_fixtures",
    "tensors_in",
    "view_for",
]

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
    return sum(size for _, size in held_storages(values, backend))


def held_storages(values: list[Any], backend: Backend) -> list[tuple[Any, int]]:
    """A tensor for each storage ``values`` hold that ``backend`` counts, with its bytes."""
    storages: dict[Any, tuple[Any, int]] = {}
    for value in values:
        for tensor in tensors_in(value):
            try:
                size = backend.storage_bytes(tensor)
                key = tensor.untyped_storage()._cdata
            except (RuntimeError, NotImplementedError, AttributeError, TypeError):
                continue  # a wrapper subclass without a storage of its own
            if size is not None:
                storages[key] = (tensor, size)
    return list(storages.values())


def broader_scoped(item: pytest.Item, known: dict[int, Any] | None = None) -> tuple[str, ...]:
    """The names of ``item``'s fixtures whose scope is broader than the function's.

    Most tests have none, and then nothing of theirs needs to be walked. ``known``, where
    given, keeps the answers: parametrized items share their fixture names and information,
    and each answer is worked out once. (pytest's FuncFixtureInfo takes no attribute and
    cannot be weakly referenced; the names list is the key, by id, kept beside the answer so
    that the id stays its own.)
    """
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return ()
    fixturenames = item.fixturenames  # type: ignore[attr-defined]
    if known is not None:
        found = known.get(id(fixturenames))
        if found is not None and found[1] is info:
            return found[2]
    names = []
    for name in fixturenames:
        definitions = info.name2fixturedefs.get(name)
        if definitions and definitions[-1].scope != "function":
            names.append(name)
    answer = tuple(names)
    if known is not None:
        known[id(fixturenames)] = (fixturenames, info, answer)
    return answer


def cached_fixture_values(
    item: pytest.Item, names: tuple[str, ...] | None = None
) -> tuple[list[Any], dict[str, Any]]:
    """The values of ``item``'s broader-scoped fixtures that an earlier test made: those this
    test reuses, and by name those made with another parameter, which its setup replaces."""
    if names is None:
        names = broader_scoped(item)
    if not names:
        return [], {}
    info = item._fixtureinfo  # type: ignore[attr-defined]
    callspec = getattr(item, "callspec", None)
    params = getattr(callspec, "params", {})
    reused, replaced = [], {}
    for name in names:
        definitions = info.name2fixturedefs.get(name)
        if not definitions:
            continue
        cached = getattr(definitions[-1], "cached_result", None)
        if cached is None or cached[0] is None:
            continue
        if name in params and not _same_parameter(cached[1], params[name]):
            replaced[name] = cached[0]
        else:
            reused.append(cached[0])
    return reused, replaced


def _same_parameter(cached_key: Any, param: Any) -> bool:
    # pytest keys a parametrized fixture's cached value by the parameter it was made with.
    try:
        return bool(cached_key == param) or cached_key is param
    except Exception:  # a parameter whose == does not answer a bool
        return cached_key is param


def view_for(item: pytest.Item, backend: Backend, names: tuple[str, ...] | None = None) -> OwnView:
    """``backend`` as ``item`` sees it: what its already made fixtures hold counts as its own.

    ``names``: those of its broader-scoped fixtures, where the caller has them.
    """
    if names is None:
        names = broader_scoped(item)
    if not names:
        return OwnView(backend, 0)
    reused, replaced = cached_fixture_values(item, names)
    storages = held_storages(reused, backend) if reused else []
    return OwnView(
        backend,
        held=sum(size for _, size in storages),
        replaced={name: held_bytes([value], backend) for name, value in replaced.items()},
        held_tensors=[tensor for tensor, _ in storages],
        fixtures=True,
    )


def still_held_by_fixtures(
    item: pytest.Item, backend: Backend, names: tuple[str, ...] | None = None
) -> int:
    """What ``item``'s broader-scoped fixtures that are still made hold, after its teardown."""
    reused = cached_fixture_values(item, names)[0]
    return held_bytes(reused, backend) if reused else 0


class OwnView:
    """A backend as one test sees it: allocated and peak bytes are the test's own.

    It passes everything else to the backend. ``begin_test`` fixes the offset: what was
    allocated then, less what the test's fixtures already held. Reserved figures are the
    test's own where the backend lays out ``own_segments`` (the simulated device), told of
    ``held_tensors``, the storages its fixtures held before it began; elsewhere they are the
    device's. Every ability of the backend's contract passes through, and ``device_backend``
    is the backend itself.
    """

    def __init__(
        self,
        backend: Backend,
        held: int,
        replaced: dict[str, int] | None = None,
        held_tensors: list[Any] | None = None,
        fixtures: bool = False,
    ) -> None:
        self._backend = backend
        self.held = held
        #: Until the test begins: kept no longer, or they would outlive their fixtures.
        self._held_tensors = held_tensors or []
        #: Whether the test has broader-scoped fixtures.
        self.fixtures = fixtures
        #: By fixture name: what the value that this test's setup replaces holds. It was
        #: another test's, and setup frees it before making this test's.
        self.replaced = dict(replaced) if replaced else {}
        self._offset = 0
        self._excluding = 0
        #: The backend viewed: its figures are the whole device's.
        self.device_backend = backend
        # What every test reads passes straight through, bound once rather than looked up
        # through __getattr__ at each read.
        self.name = backend.name
        laid_out = backend.own_segments is not None
        # Without own segments the own figures are the device's: one call less at each read.
        self.reserved = backend.own_reserved if laid_out else backend.reserved
        self.peak_reserved = backend.own_peak_reserved if laid_out else backend.peak_reserved
        self._own_memory = backend.own_memory if laid_out and fixtures else None
        if self._own_memory is None:
            self._held_tensors = []
        self._restart_own = backend.restart_own
        self.peak_device = backend.peak_device
        self.counters = backend.counters
        self.end_test = backend.end_test
        self.reset_peak = backend.reset_peak

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    def begin_test(self) -> None:
        if self._own_memory is not None:
            self._own_memory(self._held_tensors)
        self._held_tensors = []
        self._backend.begin_test()
        self._offset = self._backend.allocated() - self.held
        self._excluding = 0

    # Not max(0, ...): these are read several times in every test, and the call costs more
    # than the subtraction.
    def allocated(self) -> int:
        own = self._backend.allocated() - self._offset
        return own if own > 0 else 0

    def peak_allocated(self) -> int:
        own = self._backend.peak_allocated() - self._offset
        return own if own > 0 else 0

    def enter_excluded(self, name: str, fold: Any) -> None:
        """The broader-scoped fixture ``name`` starts being made: ``fold()`` keeps the peaks
        so far."""
        if self._excluding == 0:
            fold()
            _tell_listeners(True)
        # pytest freed the value it replaces right before: that memory was not this test's.
        self._offset -= self.replaced.pop(name, 0)
        self._excluding += 1

    def exit_excluded(self) -> None:
        """It is made: what making it cost above what it holds is forgotten."""
        self._excluding -= 1
        if self._excluding == 0:
            self._restart_own()
            self._backend.reset_peak()
            _tell_listeners(False)


def _tell_listeners(started: bool) -> None:
    # Attribution listens to a storage tracker; none does before the module is imported (and
    # importing it imports torch).
    tracker = sys.modules.get("pytest_vram.backends.tracker")
    if tracker is not None:
        tracker.making_fixture(started)
