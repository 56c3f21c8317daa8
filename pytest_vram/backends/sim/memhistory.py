"""PyTorch's memory-debugging recipe on the simulated device.

``torch.cuda.memory._record_memory_history()``, then the code under study, then
``torch.cuda.memory._snapshot()`` (or ``_dump_snapshot(path)``) gives the allocator's segments,
its blocks with the Python stack that allocated each, and the history of allocations and
frees, which ``python -m torch.cuda._memory_viz`` and https://pytorch.org/memory_viz draw. The
simulated allocator has all of it: a :class:`~pytest_vram.backends.tracelog.TraceLog` listens to
the device's storage tracker, as ``--vram-snapshot-on-fail`` does, and writes the same dict.

The recording lasts until ``_record_memory_history(enabled=None)`` or the end of the test; a
snapshot without one lists the segments and blocks, without stacks or history, as on a GPU.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.cuda.memory

from pytest_vram.backends.tracelog import TraceLog

__all__ = ["MemoryHistory"]

_STATES = ("all", "state", None)


class _Device(Protocol):
    """What the history reads of the simulated device (the sim backend)."""

    tracker: Any
    segments: Any


class MemoryHistory:
    """The allocator history of the simulated device, as ``torch.cuda.memory`` records it."""

    def __init__(self, device: _Device) -> None:
        self._device = device
        self._log: TraceLog | None = None
        #: What was recorded: ``"all"`` (the blocks' stacks and the history) or ``"state"``.
        self._enabled: str | None = None
        self._context = True
        self._listening = False
        #: The segment listener set while recording, and the one it passes events on to.
        self._told: Any = None
        self._previous: Any = None

    def record(
        self,
        enabled: str | bool | None = "all",
        context: str | None = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        device: Any = None,
        clear_history: bool = False,
        *args: Any,
        **kwargs: Any,
    ) -> None:
        """``torch.cuda.memory._record_memory_history``, both its forms: ``enabled`` one of
        ``"all"``, ``"state"`` or None (stop), or the older True or False."""
        if isinstance(enabled, bool):
            # The older form: _record_memory_history(True, record_context=..., ...).
            max_entries = kwargs.get("trace_alloc_max_entries", 1)
            enabled = ("all" if max_entries > 1 else "state") if enabled else None
            context = "all"
        if enabled not in _STATES:
            raise ValueError(f"enabled must be one of {_STATES}, got {enabled!r}")
        if enabled is None:
            self.stop()
            return
        if self._log is None or clear_history:
            self._stop_listening()
            self._log = TraceLog(self._device.segments, max_entries=max(1, int(max_entries)))
        self._enabled = enabled
        self._context = context is not None
        if not self._listening:
            self._device.tracker.add_listener(self._log)
            segments = self._device.segments
            previous = segments.segment_listener
            log = self._log

            def told(action: str, address: int, size: int) -> None:
                if previous is not None:  # --vram-snapshot-on-fail's log hears it too
                    previous(action, address, size)
                log.segment_event(action, address, size)

            segments.segment_listener = self._told = told
            self._previous = previous
            self._listening = True

    def snapshot(self, device: Any = None, augment_with_fx_traces: bool = False) -> dict[str, Any]:
        """``torch.cuda.memory._snapshot``: the segments and blocks now, with the stacks and
        history recorded since ``_record_memory_history``."""
        self._device.tracker.flush()  # frees of storages that died reach the segments first
        log = self._log if self._log is not None else TraceLog(self._device.segments)
        snapshot = log.snapshot()
        if self._enabled != "all":
            snapshot["device_traces"] = [[]]
        if self._log is None or not self._context:
            for segment in snapshot["segments"]:
                for block in segment["blocks"]:
                    block["frames"] = []
            for trace in snapshot["device_traces"]:
                for entry in trace:
                    entry["frames"] = []
        return snapshot

    def segments(self, device: Any = None) -> list[dict[str, Any]]:
        """``torch.cuda.memory_snapshot``: the segments of :meth:`snapshot`."""
        return self.snapshot()["segments"]

    def stop(self) -> None:
        """Stop recording and forget the history (the test is over, or it asked)."""
        self._stop_listening()
        self._log = None
        self._enabled = None

    def _stop_listening(self) -> None:
        if not self._listening:
            return
        self._listening = False
        self._device.tracker.remove_listener(self._log)
        segments = self._device.segments
        # Put back what listened before, unless it was taken away meanwhile (its test ended).
        if segments.segment_listener is self._told:
            segments.segment_listener = self._previous
        self._told = self._previous = None

    def replacements(self) -> Iterator[tuple[object, str, object]]:
        """What to set in ``torch.cuda`` and ``torch.cuda.memory`` while a test runs."""
        memory = torch.cuda.memory
        yield memory, "_record_memory_history", self.record
        yield memory, "_snapshot", self.snapshot  # _dump_snapshot calls it
        yield memory, "memory_snapshot", self.segments
        yield torch.cuda, "memory_snapshot", self.segments
