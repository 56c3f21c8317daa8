"""The session's side of attribution: which tests get a breakdown, and taking it.

Every measured test on the sim and cpu backends records the category totals of its peak, so
that any regression or budget failure can say which categories grew: from the sim's and the cpu
dispatch counter's storage tracker, or from the log in C++ of the cpu allocator counter and of
the sim's op counter (which counts a computing test). The per-module
breakdown is taken only under ``--vram-breakdown``. On cuda a test gets them when
``--vram-breakdown`` is given or its baseline entry stores category totals (a tracker is pushed
for it then); other tests run exactly as without attribution.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vram.attribution.breakdown import GLOBAL_HOOKS, PeakBreakdown, entry_categories
from pytest_vram.attribution.sources import TrackerSource
from pytest_vram.record.record import TestRecord

__all__ = ["Attribution"]


class Attribution:
    """Per session: starts a test's breakdown, takes it when the call ends, and cleans up."""

    #: Whether every sim and cpu test records its peak's category totals.
    categories_by_default = True

    def __init__(self, breakdown: bool = False) -> None:
        self.breakdown = breakdown
        self._source: Any = None
        self._peak: Any = None
        self._modules = False
        self._holding = False
        # backend -> whether it sees allocations (_sees_allocations), asked once
        self._sees: dict[Any, bool] = {}

    def wants_breakdown(self, entry: Mapping[str, Any] | None, backend: Any = None) -> bool:
        """Whether the test measured on ``backend`` with baseline ``entry`` records its peak's
        categories (the whole breakdown under ``--vram-breakdown``)."""
        if self.breakdown:
            return True
        if backend is not None and self.categories_by_default and self._sees_allocations(backend):
            return True
        return entry is not None and entry_categories(entry) is not None

    def begin(self, backend: Any) -> bool:
        """Start logging for the breakdown of a test that wants one (:meth:`wants_breakdown`);
        whether ``backend`` can give one."""
        self.end()
        if not self._holding:  # the session's other tests will want them too
            GLOBAL_HOOKS.hold(True)
            self._holding = True
        tracker = self._log_of(backend)
        if tracker is None:
            source = TrackerSource(backend)
            tracker = source.open()
            if tracker is None:
                return False
            self._source = source
        self._modules = self.breakdown
        self._peak = PeakBreakdown(tracker, modules=self._modules)
        self._peak.start()
        return True

    def finish_call(self, record: TestRecord) -> None:
        """The test's peak by category into ``record.categories`` and, under
        ``--vram-breakdown``, the whole breakdown into ``record.breakdown``."""
        if self._peak is None:
            return
        result = self._peak.result(record.peak_allocated)
        record.categories = result["categories"]
        if self._modules:
            record.breakdown = result
        self.end()

    def close(self) -> None:
        """At the end of the session: the global hooks go."""
        self.end()
        if self._holding:
            GLOBAL_HOOKS.hold(False)
            self._holding = False

    def _sees_allocations(self, backend: Any) -> bool:
        sees = self._sees.get(backend)
        if sees is None:
            sees = self._sees[backend] = _sees_allocations(backend)
        return sees

    def _log_of(self, backend: Any) -> Any:
        """The log the backend keeps of what it counts now, if it keeps one (the cpu allocator
        counter's; the simulated device's op counter's while the test counts there)."""
        allocation_log = backend.allocation_log
        return allocation_log() if allocation_log is not None else None

    def end(self) -> None:
        if self._peak is not None:
            self._peak.stop()
            self._peak = None
        if self._source is not None:
            self._source.close()
            self._source = None


def _sees_allocations(backend: Any) -> bool:
    """Whether the backend has a tracker of its own (sim, the cpu dispatch counter) or logs
    what it counts (the cpu allocator counter). A tracker pushed for one test (cuda) would cost
    every op a Python call: a small test's time 1.2x."""
    return backend.tracker is not None or backend.allocation_log is not None
