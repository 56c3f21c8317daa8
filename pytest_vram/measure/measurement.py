"""One test's figures, read from a backend across its setup, call and teardown.

Backends keep a single peak counter, but a test may reset it (``vram.single_step``) and nest
``vram.measure()`` blocks. A :class:`PeakWindow` is one span whose peak is wanted; every reset
first folds the backend's peak into each open window, so no window loses its maximum.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pytest_vram.backends.base import Backend
from pytest_vram.garbage import collect_garbage
from pytest_vram.record.record import TestRecord

if TYPE_CHECKING:
    from pytest_vram.marks import VramMarks
    from pytest_vram.verdict import Verdict

__all__ = ["PeakWindow", "TestMeasurement"]


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

    def __init__(self, backend: Backend, nodeid: str, device: str | None = None) -> None:
        self.backend = backend
        self.record = TestRecord(nodeid, backend.name, device or backend.device_class)
        #: The test's parsed markers, set by the session.
        self.marks: VramMarks | None = None
        #: The test's baseline entry on its device, None when it has none or is not gated.
        self.entry: Mapping[str, int] | None = None
        #: Whether the test opted in (a vram marker or fixture), set by the session.
        self.opted_in = True
        #: Whether the test is compared with its baseline, stored and held to --vram-strict.
        self.gated = True
        #: The names of the test's broader-scoped fixtures, whose values count as its own.
        self.fixtures: tuple[str, ...] = ()
        #: Whether the test's peak is broken down (attribution).
        self.attributed = False
        #: Under ``vram_world_size`` on the sim: the fake process group the test runs in.
        self.ranks: Any = None
        #: What setup or the call raised (a failure or a skip): its frames hold the test's
        #: tensors.
        self.raised: BaseException | None = None
        #: The memory verdict, once judged.
        self.verdict: Verdict | None = None
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
