"""The cpu allocator counter's log of allocations, seen as attribution sees a storage tracker.

The allocator counter sees no tensor, only blocks: while a breakdown listens, it logs in C++
each block it counts and each free, with a code for where the test's thread was when it
allocated (in a module's forward, an optimizer's step, ...), which the breakdown keeps up to
date through :meth:`AllocatorLog.note_place`. Nothing runs in Python per allocation, and the log
is never read into Python: the library tags each block it logs, answers a tensor's tag
(:meth:`AllocatorLog.tag_of`), and replays the log to its peak itself, handing back only the
blocks alive then (:meth:`AllocatorLog.live_at_peak`). It keeps the bytes alive at the peak by
place as the log grows, and a test whose tensors no hook met (no module, no optimizer) reads
those in place, with no call.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from pytest_vram.backends.cpu.allocator import LOG_PLACES
from pytest_vram.backends.tracker import listen_for_fixtures

if TYPE_CHECKING:
    import torch

    from pytest_vram.backends.cpu.allocator import AllocatorCounter

__all__ = ["AllocatorLog"]


class AllocatorLog:
    """What a :class:`~pytest_vram.backends.tracker.StorageTracker` offers a listener
    (``add_listener``, ``remove_listener``, ``flush``, ``tag_of``), from ``counter``'s log, and
    the replay to the peak that a listener would otherwise make of the events it is told
    (:meth:`peak_from_here`, :meth:`live_at_peak`)."""

    def __init__(self, counter: AllocatorCounter) -> None:
        self.counter = counter
        self.listeners: tuple[Any, ...] = ()
        # Where the thread was, by code: a place is whatever the listener passed note_place.
        # Code 0 is where nothing was noted, and where a block counted before the log began
        # was allocated: None, unknown.
        self._places: list[Any] = [None]
        self._codes: dict[Any, int] = {}

    def add_listener(self, listener: Any) -> None:
        if self.listeners:
            raise RuntimeError("the allocator counter's log has one listener at a time")
        self.listeners = (listener,)
        self.counter.where.value = 0
        self.counter.start_log()
        listen_for_fixtures(self, True)

    def remove_listener(self, listener: Any) -> None:
        self.counter.stop_log()
        self.listeners = ()
        listen_for_fixtures(self, False)

    def note_place(self, place: Any) -> None:
        """From now on the thread's allocations are made at ``place`` (hashable)."""
        self.counter.where.value = self.code_of(place)

    def code_of(self, place: Any) -> int:
        """The where code of ``place`` (hashable), given it now if it has none."""
        code = self._codes.get(place)
        if code is None:
            code = self._codes[place] = len(self._places)
            self._places.append(place)
        return code

    def making_fixture(self, started: bool) -> None:
        for listener in self.listeners:
            told = getattr(listener, "making_fixture", None)
            if told is not None:
                told(started)

    def flush(self) -> None:
        """Nothing waits to be handed over: the log stays in the library."""

    def peak_from_here(self) -> None:
        """Look for the peak from here on: what came before (a fixture made) is not the test's."""
        self.counter.log_peak_from_here()

    def live_at_peak(self, by_place: bool = False) -> Iterable[tuple[int | None, int, Any]]:
        """The blocks alive at the log's peak: (tag, bytes, place) each. ``by_place``: the
        caller needs no block's tag, only where each was allocated, and gets the bytes alive
        by place (tag None), read without a call where there are few places."""
        places = self._places
        if by_place and len(places) <= LOG_PLACES:
            by_where = self.counter.log_peak_by_where(len(places))
            pairs = zip(by_where, places, strict=True)
            return [(None, size, place) for size, place in pairs if size]
        blocks = self.counter.log_peak()
        where = map(places.__getitem__, blocks[2::3])
        return zip(blocks[0::3], blocks[1::3], where, strict=True)

    def tag_of(self, tensor: torch.Tensor) -> int | None:
        """The tag of the block that holds ``tensor``'s storage, when the counter counts it; a
        block counted before the log began gets one now, alive since the log began."""
        if not tensor.is_cpu:
            return None
        try:
            data = tensor.untyped_storage().data_ptr()
        except (NotImplementedError, RuntimeError):
            return None
        return self.counter.log_tag(data) or None
