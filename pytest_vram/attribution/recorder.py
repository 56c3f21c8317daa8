"""The session's side of attribution: which tests get a breakdown, and taking it.

A measured test's peak is broken down when ``--vram-breakdown`` is given, or when its baseline
entry stores category totals (so that a regression can say which categories grew). Other tests
run exactly as without attribution.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vram.attribution.breakdown import entry_categories
from pytest_vram.record.record import TestRecord

__all__ = ["Attribution"]


class Attribution:
    """Per session: starts a test's breakdown, takes it when the call ends, and cleans up."""

    def __init__(self, breakdown: bool = False) -> None:
        self.breakdown = breakdown
        self._source: Any = None
        self._peak: Any = None

    def wants_breakdown(self, entry: Mapping[str, Any] | None) -> bool:
        if self.breakdown:
            return True
        return entry is not None and entry_categories(entry) is not None

    def begin(self, backend: Any) -> bool:
        """Start logging for the breakdown of a test that wants one (:meth:`wants_breakdown`);
        whether ``backend`` can give one."""
        self.end()
        from pytest_vram.attribution.breakdown import PeakBreakdown
        from pytest_vram.attribution.sources import TrackerSource

        source = TrackerSource(backend)
        tracker = source.open()
        if tracker is None:
            return False
        self._source = source
        self._peak = PeakBreakdown(tracker)
        self._peak.start()
        return True

    def finish_call(self, record: TestRecord) -> None:
        """Break the test's peak down into ``record.breakdown``."""
        if self._peak is None:
            return
        record.breakdown = self._peak.result(record.peak_allocated)
        self.end()

    def end(self) -> None:
        if self._peak is not None:
            self._peak.stop()
            self._peak = None
        if self._source is not None:
            self._source.close()
            self._source = None
