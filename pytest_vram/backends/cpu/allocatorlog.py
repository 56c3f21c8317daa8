"""The cpu allocator counter's log of allocations, seen as attribution sees a storage tracker.

The allocator counter sees no tensor, only blocks: while a breakdown listens, it logs in C++
each block it counts and each free, with a code for where the test's thread was when it
allocated (in a module's forward, an optimizer's step, ...), which the breakdown keeps up to
date through :meth:`AllocatorLog.note_place`. Nothing runs in Python per allocation: the log is
read when the breakdown asks for tags, when a broader-scoped fixture starts or ends, and at the
end of the test, and handed to the listener in order, each block tagged as a tracker tags a
storage. A tensor's tag is that of the block at its storage's data pointer now.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_vram.backends.tracker import listen_for_fixtures

if TYPE_CHECKING:
    import torch

    from pytest_vram.backends.cpu.allocator import AllocatorCounter

__all__ = ["AllocatorLog"]


class AllocatorLog:
    """What a :class:`~pytest_vram.backends.tracker.StorageTracker` offers a listener
    (``add_listener``, ``remove_listener``, ``flush``, ``tag_of``), from ``counter``'s log."""

    def __init__(self, counter: AllocatorCounter) -> None:
        self.counter = counter
        self.listeners: tuple[Any, ...] = ()
        self._read = 0
        # data pointer -> the tag of the block there now
        self._tags: dict[int, int] = {}
        self._last_tag = 0
        # Where the thread was, by code: a place is whatever the listener passed note_place.
        self._places: list[Any] = [None]
        self._codes: dict[Any, int] = {}

    def add_listener(self, listener: Any) -> None:
        if self.listeners:
            raise RuntimeError("the allocator counter's log has one listener at a time")
        self.listeners = (listener,)
        self._read = 0
        self._tags.clear()
        self.counter.where.value = 0
        self.counter.log(True)
        listen_for_fixtures(self, True)

    def remove_listener(self, listener: Any) -> None:
        self.counter.log(False)
        self.listeners = ()
        self._tags.clear()
        listen_for_fixtures(self, False)

    def note_place(self, place: Any) -> None:
        """From now on the thread's allocations are made at ``place`` (hashable)."""
        code = self._codes.get(place)
        if code is None:
            code = self._codes[place] = len(self._places)
            self._places.append(place)
        self.counter.where.value = code

    def making_fixture(self, started: bool) -> None:
        self.flush()  # what was allocated before belongs before
        for listener in self.listeners:
            told = getattr(listener, "making_fixture", None)
            if told is not None:
                told(started)

    def flush(self) -> None:
        """Hand the events logged since the last flush to the listener, in order."""
        if self.counter.logged == self._read or not self.listeners:
            return
        events = self.counter.read_log(self._read)
        self._read += len(events) // 3
        (listener,) = self.listeners
        tags, places = self._tags, self._places
        for index in range(0, len(events), 3):
            data, size, where = events[index], events[index + 1], events[index + 2]
            if size > 0:
                self._last_tag += 1
                tags[data] = self._last_tag
                listener.allocated(self._last_tag, size, None, places[where])
            else:
                listener.freed(tags.pop(data, None), -size, None)

    def tag_of(self, tensor: torch.Tensor) -> int | None:
        """The tag of the block that holds ``tensor``'s storage, when the counter counts it; a
        block counted before the log began gets one now, and the listener learns of it as
        allocated before."""
        if not tensor.is_cpu:
            return None
        try:
            data = tensor.untyped_storage().data_ptr()
        except (NotImplementedError, RuntimeError):
            return None
        self.flush()
        tag = self._tags.get(data)
        if tag is None:
            size = self.counter.counted_bytes(data)
            if not size:
                return None
            self._last_tag += 1
            tag = self._tags[data] = self._last_tag
            for listener in self.listeners:
                listener.adopted(tag, size, None)
        return tag
