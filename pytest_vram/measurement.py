"""One test's figures, read from a backend across its setup, call and teardown.

Backends keep a single peak counter, but a test may reset it (``vram.single_step``) and nest
``vram.measure()`` blocks. A :class:`PeakWindow` is one span whose peak is wanted; every reset
first folds the backend's peak into each open window, so no window loses its maximum.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pytest_vram.backends.base import Backend
from pytest_vram.records import TestRecord

if TYPE_CHECKING:
    from pytest_vram.marks import VramMarks
    from pytest_vram.verdict import Verdict

__all__ = ["OLD_GARBAGE", "OldGarbage", "PeakWindow", "TestMeasurement", "collect_garbage"]


class OldGarbage:
    """Whether a full garbage collection may free what a collection of the young generations
    cannot, while a session runs (:meth:`watch`).

    The young collection misses only garbage in the oldest generation. Objects get there by
    surviving a collection of generation 1: an automatic one, which a busy test's objects
    survive, or this plugin's own, which what is alive at a test's end survives. What is alive
    then is held by something that outlives the test: a broader-scoped fixture (its finaliser
    lets go, :meth:`let_go`), a failed test's exception (let go too), or a global. So after a
    full collection, until an automatic collection of generation 1 or a :meth:`let_go`, a full
    one finds nothing more; a test that keeps memory on purpose, such as a cache, then costs
    a young collection and not a full one each time. Where the collector is not
    generational (Python 3.14 collects the old generation in increments), every test that
    ends above its floor gets a full collection.
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
        gc.collect()
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
        if generation >= 2:
            self.possible = False  # everything was looked at
        elif generation == 1 and not self._ours:
            self.possible = True


_GENERATIONAL = sys.version_info < (3, 14)

#: The session's: watched while its tests run.
OLD_GARBAGE = OldGarbage()


def collect_garbage(backend: Backend, floor: int, old: OldGarbage = OLD_GARBAGE) -> int:
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


class PeakWindow:
    """The peaks of allocated, reserved and device-level memory over one span."""

    def __init__(self, allocated: int, reserved: int | None) -> None:
        self.allocated = allocated
        self.reserved = reserved
        self.device: int | None = None

    def fold(self, allocated: int, reserved: int | None, device: int | None) -> None:
        # Spelled out, without max(): this runs at every peak reset and at every test's end.
        if allocated > self.allocated:
            self.allocated = allocated
        if reserved is not None and (self.reserved is None or reserved > self.reserved):
            self.reserved = reserved
        if device is not None and (self.device is None or device > self.device):
            self.device = device


class TestMeasurement:
    """Reads one test's figures from ``backend`` into a :class:`TestRecord`."""

    __test__ = False  # not a test class, whatever pytest's name matching thinks

    # What most tests keep as it is: set on the measurement only where it differs.
    #: The test's baseline entry on its device, None when it has none.
    entry: Mapping[str, int] | None = None
    #: The names of the test's broader-scoped fixtures, whose values count as its own.
    fixtures: tuple[str, ...] = ()
    #: Whether the test's peak is broken down (attribution).
    attributed = False
    #: The test's parsed markers, set by the session.
    marks: VramMarks | None = None
    #: What setup or the call raised (a failure or a skip): its frames hold the test's
    #: tensors.
    raised: BaseException | None = None
    #: The memory verdict, once judged.
    verdict: Verdict | None = None
    #: Under ``vram_world_size`` on the sim: the fake process group the test runs in.
    ranks: Any = None

    def __init__(self, backend: Backend, nodeid: str, device: str | None = None) -> None:
        self.backend = backend
        self.record = TestRecord(nodeid, backend.name, device or backend.device_class)
        self._windows: list[PeakWindow] = []
        self._test_window: PeakWindow | None = None

    # -- the test's lifecycle -------------------------------------------------------------

    def begin(self) -> None:
        """Start measuring; call before the test's fixtures are set up."""
        backend = self.backend
        backend.begin_test()
        # open_window(), without a fold: no window is open yet.
        backend.reset_peak()
        window = self._test_window = PeakWindow(backend.allocated(), backend.reserved())
        self._windows.append(window)
        self.record.start_allocated = window.allocated

    def finish_call(self) -> None:
        """Freeze the peaks of setup and call; call when the test body has returned."""
        window = self._test_window
        if window is None:
            return
        self.close_window(window)
        self._test_window = None
        record = self.record
        record.peak_allocated = window.allocated
        record.peak_reserved = window.reserved
        record.peak_device = window.device
        record.counters = self.backend.counters()
        if self.backend.order_dependent_figures:
            record.unstored = sorted(self.backend.order_dependent_figures)

    def end(self) -> None:
        """Read what the test left allocated; call after its teardown."""
        self.finish_call()
        # cuBLAS's workspaces outlive the test that made them, and are no leak of its.
        self.backend.release_workspaces()
        left = self.backend.allocated()
        if left > self.record.start_allocated:
            left = collect_garbage(self.backend, self.record.start_allocated)
        self.record.end_allocated = left
        self.backend.end_test()

    # -- peak windows ---------------------------------------------------------------------

    def allocated(self) -> int:
        return self.backend.allocated()

    def open_window(self) -> PeakWindow:
        self.reset_peak()
        window = PeakWindow(self.backend.allocated(), self.backend.reserved())
        self._windows.append(window)
        return window

    def close_window(self, window: PeakWindow) -> PeakWindow:
        self._fold()
        if window in self._windows:
            self._windows.remove(window)
        return window

    def reset_peak(self) -> None:
        """Start a new backend peak without losing any open window's maximum."""
        self._fold()
        self.backend.reset_peak()

    def peak(self) -> int:
        """The backend's peak allocated since the last reset."""
        return self.backend.peak_allocated()

    def release_cache(self) -> None:
        self.backend.release_cache()

    def _fold(self) -> None:
        if not self._windows:
            return
        allocated = self.backend.peak_allocated()
        reserved = self.backend.peak_reserved()
        device = self.backend.peak_device()
        for window in self._windows:
            window.fold(allocated, reserved, device)
