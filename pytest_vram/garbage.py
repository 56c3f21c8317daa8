"""Collecting what a test left: the young generations first, the whole heap only when that may
free more, with what existed before the run frozen out of the walk."""

from __future__ import annotations

import gc
import sys
from typing import Protocol

__all__ = ["OLD_GARBAGE", "OldGarbage", "collect_garbage"]


class Device(Protocol):
    """What a collection reads of a backend: its allocated bytes."""

    def allocated(self) -> int: ...


class OldGarbage:
    """Whether a full garbage collection may free what a collection of the young generations
    cannot, while a session runs (:meth:`watch`).

    The young collection misses only garbage in the oldest generation. Objects get there by
    surviving a collection of generation 1 or 2: an automatic one, which a busy test's objects
    survive while the test runs, or this plugin's own, which what is alive at a test's end
    survives. What is alive then is held by something that outlives the test: a
    broader-scoped fixture (its finaliser lets go, :meth:`let_go`), a failed test's exception
    (let go too), or a global. So after this plugin's full collection, until an automatic
    collection of generation 1 or 2 or a :meth:`let_go`, a full one finds nothing more; a
    test that keeps memory on purpose, such as a cache, then costs a young collection and not
    a full one each time. Where the collector is not generational (Python 3.14 collects the
    old generation in increments), every test that ends above its floor gets a full
    collection.
    """

    def __init__(self) -> None:
        #: False: a full collection would find nothing a young one does not.
        self.possible = True
        self._watching = False
        self._ours = False
        #: The modules there were at the last freeze; -1 after a thaw.
        self._modules = 0
        #: Whether a freeze since the last thaw may have frozen a broader-scoped fixture's
        #: value.
        self._fixtures_frozen = False
        #: How many freezes there were for imports: a fixture made before the last one was
        #: frozen by it.
        self.freezes = 0

    def watch(self) -> None:
        """Start watching, with what exists now frozen (``gc.freeze()``): with torch imported
        that is millions of objects, made at import and collection and none of them a
        test's, which a full collection then leaves out."""
        if self._watching:
            return
        gc.freeze()
        self._modules = len(sys.modules)
        if _GENERATIONAL:
            gc.callbacks.append(self._seen)
        self._watching = True

    def unwatch(self) -> None:
        if self._watching:
            if _GENERATIONAL:
                gc.callbacks.remove(self._seen)
            gc.unfreeze()
            self._watching = False
        self.possible = True

    def let_go(self, made_at: int | None = None) -> None:
        """What outlived a test (an exception, or a broader-scoped fixture, with
        :attr:`freezes` when it was made) may be garbage now."""
        self.possible = True
        if made_at is not None and self._fixtures_frozen and made_at < self.freezes:
            # Frozen, the fixture's reference cycles would wait for the session's end: thawed,
            # the next full collection frees them, and freezes again what survives it.
            gc.unfreeze()
            self._fixtures_frozen = False
            self._modules = -1

    def collect_all(self) -> None:
        """A full collection. Modules imported since the last freeze (a library's lazy
        imports, such as torch._dynamo and sympy) bring hundreds of thousands of objects that
        are never garbage and that every later full collection would walk. Right after a full
        collection nothing is garbage, so what survives it is frozen too when modules were
        imported, or after a thaw. A broader-scoped fixture frozen so is thawed when it ends
        (:meth:`let_go`); other objects that were alive then and become cyclic garbage later
        are collected after the session."""
        self._ours = True
        try:
            gc.collect()
        finally:
            self._ours = False
        modules = len(sys.modules)
        if self._watching and modules != self._modules:
            gc.freeze()
            # Refrozen after a thaw, not for an import: no thaw for it, or each fixture's end
            # would thaw again.
            if self._modules >= 0:
                self._fixtures_frozen = True
                self.freezes += 1
            self._modules = modules

    def collect_young(self) -> None:
        self._ours = True
        try:
            gc.collect(1)
        finally:
            self._ours = False

    def _seen(self, phase: str, info: dict[str, int]) -> None:
        if phase != "stop":
            return
        generation = info["generation"]
        if self._ours:
            if generation >= 2:
                self.possible = False  # everything was looked at, between tests
        elif generation >= 1:
            # An automatic collection, in a test: what it found alive (the test's model, its
            # optimizer) went on to an older generation, and is garbage once the test ends.
            self.possible = True


_GENERATIONAL = sys.version_info < (3, 14)

#: The session's: watched while its tests run.
OLD_GARBAGE = OldGarbage()


def collect_garbage(backend: Device, floor: int, old: OldGarbage = OLD_GARBAGE) -> int:
    """Collect the reference cycles that keep memory above ``floor`` allocated; what is still
    allocated then.

    The young generations first, where the cycles a test just made are: that is the cost of a
    full collection only when they did not free enough, and ``old`` says it may.
    """
    old.collect_young()
    left = backend.allocated()
    if left > floor and old.possible:
        old.collect_all()
        left = backend.allocated()
    return left
