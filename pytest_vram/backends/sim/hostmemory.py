"""The host memory a computing simulated test may hold, and how it is held to it.

A test that computes its values runs on real CPU tensors: on a large model it could take all
of the host's memory and wake the kernel's out-of-memory killer. :class:`HostLimit` leaves the
host a margin: the counting (the tracker's check, or the op counter's own limit) refuses an
allocation past it with :class:`HostMemoryExceeded`, and a limit on the process's data
(``RLIMIT_DATA``) makes a kernel's own allocation that cannot fit fail cleanly too.
"""

from __future__ import annotations

import contextlib
import resource
import time

import torch

from pytest_vram.units import format_size

__all__ = [
    "GUESS_BUDGET",
    "HOST_MARGIN",
    "HOST_MESSAGE_START",
    "HostLimit",
    "HostMemoryExceeded",
    "available_host_memory",
]

#: How every message about the host's memory begins (a message that says it all).
HOST_MESSAGE_START = "the simulated device computes this test's values on the CPU"

#: What computing leaves the rest of the host: a tenth of what was available, at least this.
HOST_MARGIN = 512 << 20
#: The most a test computing on a guess may hold: past it, computing was the wrong guess
#: (shape-only, the test needs no host memory), and a cheap one to have made.
GUESS_BUDGET = 1 << 30


class HostMemoryExceeded(torch.OutOfMemoryError):
    """Computing a test's values on the CPU would need more memory than the host has.

    The op counter refuses such an allocation with a ``torch.OutOfMemoryError`` of the same
    message; the tracker, with this subclass of it."""


def available_host_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where there is no such file.

    Read again after a second at most: each computing test asks, and the figure moves slowly
    next to the margin the limit leaves."""
    global _available_read
    now = time.monotonic()
    read_at, available = _available_read
    if now - read_at < _AVAILABLE_FOR_S:
        return available
    available = _read_available()
    _available_read = (now, available)
    return available


_AVAILABLE_FOR_S = 1.0
_available_read: tuple[float, int | None] = (-_AVAILABLE_FOR_S, None)


def _proc_figure(path: str, key: str) -> int | None:
    """The figure of ``key`` in a ``/proc`` file of ``key: value kB`` lines, in bytes."""
    try:
        with open(path, encoding="ascii") as lines:
            for line in lines:
                if line.startswith(key):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _read_available() -> int | None:
    return _proc_figure("/proc/meminfo", "MemAvailable:")


def _data_size() -> int | None:
    """The process's data segment and private writable mappings (``VmData``), in bytes."""
    return _proc_figure("/proc/self/status", "VmData:")


class HostLimit:
    """What one computing test may hold: :meth:`start` measures the room the host has, the
    counting is limited to it, and :meth:`stop` lifts the limits again."""

    def __init__(self) -> None:
        #: What the host had available when the test started.
        self.available: int | None = None
        #: The bytes the test may add to what was counted when it started; None: no limit.
        self.room: int | None = None
        #: The most the tracker may count (None where it is not the tracker that is limited).
        self.limit: int | None = None
        #: Whether the test computes on a guess, within :data:`GUESS_BUDGET`.
        self.guessing = False
        #: Why it computes: what the shape-only run failed with, for messages.
        self.reason: str | None = None
        self._saved_data_limit: tuple[int, int] | None = None

    def start(self) -> int | None:
        """The room a computing test has: what the host has available less its margin, and
        on a guess :data:`GUESS_BUDGET` at most."""
        available = self.available = available_host_memory()
        room = None if available is None else max(0, available - max(HOST_MARGIN, available // 10))
        if self.guessing:
            room = GUESS_BUDGET if room is None else min(room, GUESS_BUDGET)
        self.room = room
        self.limit = None
        return room

    def limit_tracker(self, counted: int, *, data: bool) -> None:
        """The tracker, which has ``counted`` bytes now, counts the test: it may count the
        room more. With ``data``, the process's data is limited to the room more too."""
        if self.room is None:
            return
        self.limit = counted + self.room
        if data:
            self._limit_data(self.room)

    def _limit_data(self, room: int) -> None:
        # A kernel writes its output before the tracker sees it: a limit on the process's
        # data makes an allocation that cannot fit fail cleanly instead of waking the
        # kernel's out-of-memory killer.
        data = _data_size()
        if data is None:
            return
        try:
            saved = resource.getrlimit(resource.RLIMIT_DATA)
            hard = saved[1]
            soft = data + room
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        except (OSError, ValueError):
            return
        self._saved_data_limit = saved

    def check(self, counted: int, nbytes: int) -> None:
        """Raise :class:`HostMemoryExceeded` if the tracker, with ``counted`` bytes, may not
        count ``nbytes`` more."""
        limit = self.limit
        if limit is None:
            return
        needed = counted + nbytes
        if needed > limit:
            raise HostMemoryExceeded(self.message(needed))

    def stop(self) -> None:
        self.limit = self.room = None
        saved, self._saved_data_limit = self._saved_data_limit, None
        if saved is not None:
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(resource.RLIMIT_DATA, saved)

    def message(self, needed: int | None, *, placeholder: str | None = None) -> str:
        """What a computing test that the host cannot hold fails with; with ``placeholder``,
        that text stands where the bytes that would be live go (the op counter fills it in)."""
        available = self.available
        if placeholder is not None:
            what = f"{placeholder} of tensors would be live"
        elif needed is not None:
            what = f"{format_size(needed)} of tensors would be live"
        else:
            what = "an allocation did not fit"
        if self.guessing:
            return (
                f"{HOST_MESSAGE_START} on a guess, which may hold {format_size(GUESS_BUDGET)}: "
                f"{what}. It runs again shape-only."
            )
        return (
            f"{HOST_MESSAGE_START}, and this host has not the memory for it: {what}, with "
            f"{format_size(available) if available is not None else 'an unknown amount'} "
            "available when the test started"
            + (f" (it needs values: {self.reason})" if self.reason else "")
            + ". Shape-only, on fake tensors, any size fits: keep the test from reading tensor "
            "values (.item(), value asserts, a DataLoader) so that it runs shape-only, or run it "
            'on a GPU runner (@pytest.mark.vram_backend("cuda")).'
        )
