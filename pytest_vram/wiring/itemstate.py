"""What values on demand asks the session of a measured test, read from the item's stash
(:class:`pytest_vram.backends.sim.ondemand.MeasuredTests`)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pytest_vram.record.record import TestRecord
from pytest_vram.stash import MARKER_ERROR, MARKS, MEASUREMENT, OPTED_IN, PROPERTIES, RECORD
from pytest_vram.wiring.selection import VRAM_FIXTURES

# What a run of a test leaves on its item that the reports of that run are made from.
_RUN_KEYS = (RECORD, MEASUREMENT, PROPERTIES)

__all__ = ["ItemState"]


class ItemState:
    """A measured test's marks, what it raised and its record, as the session left them;
    ``discard`` forgets a record the session collected, ``collect`` collects it again."""

    def __init__(
        self, discard: Callable[[TestRecord], None], collect: Callable[[TestRecord], None]
    ) -> None:
        self._discard = discard
        self._collect = collect

    def backend_of(self, item: pytest.Item) -> str | None:
        marks = item.stash.get(MARKS, None)
        if marks is None or MARKER_ERROR in item.stash:
            return None
        return marks.backend or ""

    def opted_in(self, item: pytest.Item) -> bool:
        return item.stash.get(OPTED_IN, True)

    def runs_plain(self, item: pytest.Item) -> bool:
        return VRAM_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))

    @contextlib.contextmanager
    def unmeasured(self, item: pytest.Item) -> Iterator[None]:
        """The session runs ``item`` as a test it does not measure while this lasts."""
        stash = item.stash
        kept = {key: stash[key] for key in (MARKS, OPTED_IN) if key in stash}
        for key in kept:
            del stash[key]
        try:
            yield
        finally:
            self.forget(item)
            for key, value in kept.items():
                stash[key] = value

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

    def set_aside(self, item: pytest.Item) -> dict[Any, Any]:
        """Forget the run that just ended, keeping what :meth:`restore` needs to make it the
        run that stands after all."""
        kept = {key: item.stash[key] for key in _RUN_KEYS if key in item.stash}
        self.forget(item)
        return kept

    def restore(self, item: pytest.Item, kept: dict[Any, Any]) -> None:
        """Forget the run that just ended; the run set aside stands."""
        self.forget(item)
        if PROPERTIES in item.stash:
            del item.stash[PROPERTIES]
        for key, value in kept.items():
            item.stash[key] = value
        record = kept.get(RECORD)
        if record is not None:
            self._collect(record)
