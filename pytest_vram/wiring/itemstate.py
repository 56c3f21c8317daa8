"""What values on demand asks the session of a measured test, read from the item's stash
(:class:`pytest_vram.backends.sim.ondemand.MeasuredTests`)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pytest_vram.record.record import TestRecord
from pytest_vram.stash import MARKER_ERROR, MARKS, MEASUREMENT, RECORD

__all__ = ["ItemState"]


class ItemState:
    """A measured test's marks, what it raised and its record, as the session left them;
    ``discard`` forgets a record the session collected."""

    def __init__(self, discard: Callable[[TestRecord], None]) -> None:
        self._discard = discard

    def backend_of(self, item: pytest.Item) -> str | None:
        marks = item.stash.get(MARKS, None)
        if marks is None or MARKER_ERROR in item.stash:
            return None
        return marks.backend or ""

    def raised_in(self, item: pytest.Item) -> BaseException | None:
        measurement = item.stash.get(MEASUREMENT, None)
        return measurement.raised if measurement is not None else None

    def forget(self, item: pytest.Item) -> None:
        record = item.stash.get(RECORD, None)
        if record is not None:
            self._discard(record)
        for key in (RECORD, MEASUREMENT):
            if key in item.stash:
                del item.stash[key]
