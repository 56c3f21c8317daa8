"""Where a leak was allocated: the sites of the storages that a leak check's confirmation steps
allocated and that were still alive after them.

The sites are recorded during the confirmation steps only, which run when a leak is already
suspected, so a passing leak check pays nothing. A storage allocated in the last confirmation
step and still alive is what the step returns or keeps until the next one, not a leak: only the
survivors of the steps before it count. On sim and cpu the tracker's listener takes the user's
frames at each allocation; on cuda the allocator records its own history
(``torch.cuda.memory._record_memory_history``), read back from ``torch.cuda.memory._snapshot()``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pytest_vram.attribution.callsites import Site, format_site, is_user_file, user_frames
from pytest_vram.attribution.sources import TrackerSource
from pytest_vram.backends.cuda.history import history_recording, resume_history
from pytest_vram.units import format_size

if TYPE_CHECKING:
    from pytest_vram.backends.base import Backend

__all__ = ["LeakSite", "LeakSiteRecorder", "describe_sites", "record_leak_sites"]

#: How many sites a failure message lists; the JSON report keeps them all.
SHOWN_SITES = 5
# Enough history for the confirmation steps of a training loop.
_CUDA_MAX_ENTRIES = 1_000_000
_UNKNOWN: Site = ("<unknown>", 0, "?")


@dataclass(frozen=True)
class LeakSite:
    """Bytes and count of the surviving storages allocated at one line of the user's code."""

    site: Site
    #: The user's frames that called it, innermost first.
    callers: tuple[Site, ...]
    bytes: int
    count: int

    def location(self) -> str:
        return format_site(self.site)

    def to_dict(self) -> dict[str, Any]:
        filename, line, name = self.site
        return {
            "file": filename,
            "line": line,
            "function": name,
            "location": self.location(),
            "bytes": self.bytes,
            "count": self.count,
            "callers": [format_site(caller) for caller in self.callers],
        }

    def describe(self) -> str:
        count = f"{self.count} allocation{'s' if self.count != 1 else ''}"
        called = f" (called from {format_site(self.callers[0])})" if self.callers else ""
        return f"{self.location()}: {format_size(self.bytes)} in {count}{called}"


def describe_sites(sites: list[LeakSite], steps: int) -> list[str]:
    """The lines a failed leak check adds to its message."""
    if not sites:
        return []
    lines = [f"still alive after the {steps} confirmation steps, by allocation site:"]
    lines += [f"  {site.describe()}" for site in sites[:SHOWN_SITES]]
    if len(sites) > SHOWN_SITES:
        rest = sites[SHOWN_SITES:]
        total = sum(site.bytes for site in rest)
        lines.append(f"  ... {len(rest)} more sites: {format_size(total)}")
    return lines


def _group(survivors: list[tuple[tuple[Site, ...], int]]) -> list[LeakSite]:
    by_site: dict[Site, list[Any]] = {}
    for frames, size in survivors:
        key = frames[0] if frames else _UNKNOWN
        entry = by_site.setdefault(key, [frames[1:], 0, 0])
        entry[1] += size
        entry[2] += 1
    sites = [LeakSite(key, tuple(c), b, n) for key, (c, b, n) in by_site.items()]
    sites.sort(key=lambda s: (-s.bytes, -s.count, s.site))
    return sites


class LeakSiteRecorder:
    """Records allocation sites between :meth:`start` and :meth:`stop`; :meth:`next_step`
    marks where each step begins. ``sites`` is the result, largest first."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.sites: list[LeakSite] = []
        self.steps = 0
        self._source: TrackerSource | None = None
        self._alive: dict[int, list[Any]] = {}
        #: Whether the allocator's own history is read (cuda), not a tracker listened to.
        self._history = backend.memory_history
        self._step_started_us = 0
        self._history_was_on = False

    # -- the tracker's listener (sim, cpu) ------------------------------------------------

    def allocated(self, tag: int, size: int, handle: Any) -> None:
        self._alive[tag] = [user_frames(3, sys._getframe(1)), size, self.steps]

    def resized(self, tag: int | None, old: int, new: int, handle: Any) -> None:
        entry = self._alive.get(tag) if tag is not None else None
        if entry is not None:
            entry[1] = new

    def freed(self, tag: int | None, size: int, handle: Any) -> None:
        if tag is not None:
            self._alive.pop(tag, None)

    # -- the recording --------------------------------------------------------------------

    def start(self) -> None:
        if self._history:
            self._start_history()
            return
        self._source = TrackerSource(self.backend)
        tracker = self._source.open()
        if tracker is not None:
            tracker.add_listener(self)

    def next_step(self) -> None:
        self.steps += 1
        if self._history:
            self._step_started_us = time.time_ns() // 1000

    def stop(self) -> None:
        if self._history:
            self.sites = self._stop_history()
            return
        source, self._source = self._source, None
        if source is None or source.tracker is None:
            return
        tracker = source.tracker
        tracker.flush()
        tracker.remove_listener(self)
        source.close()
        last = self.steps
        survivors = [(frames, size) for frames, size, step in self._alive.values() if step < last]
        self._alive.clear()
        self.sites = _group(survivors)

    def __enter__(self) -> LeakSiteRecorder:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- cuda: the allocator's own history ------------------------------------------------

    def _start_history(self) -> None:
        import torch

        self._history_was_on = history_recording()
        torch.cuda.memory._record_memory_history(
            max_entries=_CUDA_MAX_ENTRIES, context="alloc", stacks="python"
        )

    def _stop_history(self) -> list[LeakSite]:
        import torch

        try:
            snapshot = torch.cuda.memory._snapshot()
        finally:
            if self._history_was_on:
                resume_history()
            else:
                torch.cuda.memory._record_memory_history(enabled=None)
        return _group(
            survivors_in_snapshot(snapshot, self.backend.device.index, self._step_started_us)
        )


def survivors_in_snapshot(
    snapshot: dict[str, Any], device: int | None, last_step_us: int
) -> list[tuple[tuple[Site, ...], int]]:
    """The blocks of a CUDA memory snapshot allocated while history was recorded (they carry
    frames) and before ``last_step_us``, with the user's frames of each, innermost first."""
    alloc_time: dict[int, int] = {}
    traces = snapshot.get("device_traces") or []
    for index, trace in enumerate(traces):
        if device is not None and len(traces) > 1 and index != device:
            continue
        for entry in trace:
            if entry.get("action") == "alloc" and "time_us" in entry:
                alloc_time[entry["addr"]] = entry["time_us"]
    survivors = []
    for segment in snapshot.get("segments") or []:
        if device is not None and segment.get("device", device) != device:
            continue
        address = segment.get("address", 0)
        for block in segment.get("blocks") or []:
            block_address = block.get("address", address)
            address = block_address + block.get("size", 0)
            frames = block.get("frames")
            if block.get("state") != "active_allocated" or not frames:
                continue
            when = alloc_time.get(block_address)
            if last_step_us and when is not None and when >= last_step_us:
                continue  # the last step's own: what it returns or keeps until the next
            user = tuple(
                (f.get("filename", "?"), int(f.get("line", 0)), f.get("name", "?"))
                for f in frames
                if is_user_file(str(f.get("filename", "")))
            )[:3]
            survivors.append((user, block.get("requested_size", block.get("size", 0))))
    return survivors


def record_leak_sites(probe: Any) -> LeakSiteRecorder | None:
    """A recorder for the backend behind a leak check's probe (a test's measurement), None
    when there is none or it sees no allocation's site."""
    backend = getattr(probe, "backend", None)  # a bare probe, in a unit test, has none
    if backend is None:
        return None
    if not (backend.memory_history or TrackerSource(backend).available):
        return None
    return LeakSiteRecorder(backend)
