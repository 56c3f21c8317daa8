"""The op counter's log, which attribution reads as it reads a storage tracker.

A computing test on the simulated device counts inside PyTorch's CPU allocator (the op
counter) where it can; a breakdown of its peak must not move it to the Python tracker, which
costs every op two Python calls (a test of small ops ran 4.5x slower). The op counter logs each
block it counts and frees, and each cuBLAS workspace, on the log of an allocator counter that
watches nothing, which :class:`~pytest_vram.backends.cpu.allocatorlog.AllocatorLog` reads.

A listener that must hear of each allocation in Python (a leak check's sites, a memory history)
moves the rest of the test to the tracker: from then on what the tracker counts is logged too,
each storage at a key made of its tracker tag, so that the breakdown sees the whole test.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pytest_vram.backends.cpu.allocator import AllocatorCounter
from pytest_vram.backends.cpu.allocatorlog import AllocatorLog
from pytest_vram.backends.sim.workspaces import WORKSPACE_NAME

if TYPE_CHECKING:
    import torch

    from pytest_vram.backends.cpu.allocator import OpCounter
    from pytest_vram.backends.tracker import StorageTracker

__all__ = ["WORKSPACE_PLACE", "OpCounterLog"]

#: Where a cuBLAS workspace is allocated: a place that names its category and unit, as the
#: tracker names a workspace's storage.
WORKSPACE_PLACE = ("cublas_workspaces", WORKSPACE_NAME)

# Keys of the tracker's storages in the log: above any data pointer a process can have.
_TRACKER_KEYS = 1 << 62


class OpCounterLog(AllocatorLog):
    """What ``ops`` counts, logged while a breakdown listens; :meth:`count_from` adds what a
    tracker counts from then on."""

    def __init__(self, ops: OpCounter) -> None:
        super().__init__(AllocatorCounter())
        ops.log_to(self.counter, self.code_of(WORKSPACE_PLACE))
        self._tracker: StorageTracker | None = None
        self._forward = _TrackerEvents(self)

    def count_from(self, tracker: StorageTracker) -> None:
        """The running test counts on ``tracker`` from now on: its storages are logged too,
        while a breakdown listens."""
        if self.listeners and self._tracker is None:
            self._tracker = tracker
            tracker.add_listener(self._forward)

    def remove_listener(self, listener: Any) -> None:
        super().remove_listener(listener)
        tracker, self._tracker = self._tracker, None
        if tracker is not None:
            tracker.remove_listener(self._forward)

    def flush(self) -> None:
        if self._tracker is not None:
            self._tracker.flush()  # frees of storages that died reach the log first

    def tag_of(self, tensor: torch.Tensor) -> int | None:
        tag = super().tag_of(tensor)
        if tag is None and self._tracker is not None:
            counted = self._tracker.tag_of(tensor)
            if counted is not None:
                tag = self.counter.log_tag(_TRACKER_KEYS + counted) or None
        return tag


class _TrackerEvents:
    """The tracker's listener that logs what it counts on an :class:`OpCounterLog`."""

    def __init__(self, log: OpCounterLog) -> None:
        self._log = log

    def allocated(self, tag: int, size: int, handle: Any) -> None:
        self._log.counter.log_event(_TRACKER_KEYS + tag, size)

    def resized(self, tag: int | None, old: int, new: int, handle: Any) -> None:
        if tag is not None:
            self.freed(tag, old, handle)
            self.allocated(tag, new, handle)

    def freed(self, tag: int | None, size: int, handle: Any) -> None:
        if tag is not None:
            self._log.counter.log_event(_TRACKER_KEYS + tag, -size)

    def named(self, tag: int, name: str) -> None:
        logged = self._log.counter.log_tag(_TRACKER_KEYS + tag)
        if logged:
            for listener in self._log.listeners:
                listener.named(logged, name)
