"""A memory snapshot in PyTorch's format from the sim and cpu backends.

:class:`TraceLog` listens to the storage tracker and keeps what
``torch.cuda.memory._record_memory_history`` would: every allocation and free with the Python
stack that made it. :meth:`TraceLog.snapshot` turns it into the dict that
``torch.cuda.memory._snapshot()`` returns (``segments`` with their ``blocks``, and
``device_traces``), which ``python -m torch.cuda._memory_viz`` and the memory_viz page read.

On sim the addresses, blocks and segments are the simulated caching allocator's own; on cpu,
which has no segments, each storage is a segment of its own at an address counted up from 0.
"""

from __future__ import annotations

import sys
import time
from bisect import bisect_left
from collections import deque
from types import FrameType
from typing import Any

__all__ = ["TraceLog", "stack"]

# As many trace entries as the cuda backend asks the allocator to keep.
MAX_ENTRIES = 100_000
_SMALL_SEGMENT = 2 << 20


def stack(start: FrameType | None = None) -> list[tuple[object, int]]:
    """The whole stack as ``(code, line)`` pairs, innermost first: cheap to take, turned into
    names only when a snapshot is written. pytest's and pluggy's own frames are left out."""
    frame = start if start is not None else sys._getframe(1)
    frames = []
    while frame is not None:
        code = frame.f_code
        filename = code.co_filename
        if "pluggy" not in filename and "_pytest" not in filename:
            frames.append((code, frame.f_lineno))
        frame = frame.f_back
    return frames


class TraceLog:
    """The allocations and frees of one test, for a snapshot; ``segments`` is the simulated
    allocator (sim), or None (cpu)."""

    def __init__(self, segments: Any = None, max_entries: int = MAX_ENTRIES) -> None:
        self.segments = segments
        # (action, addr, size, frames, time_us); frames as (code, line) pairs, innermost first.
        self.entries: deque[tuple[str, int, int, list[Any], int]] = deque(maxlen=max_entries)
        # tag -> [addr, size, requested, frames] of the storages alive now.
        self.live: dict[int, list[Any]] = {}
        self._next_addr = 0
        self._names: dict[tuple[Any, int], dict[str, Any]] = {}

    # -- listeners ------------------------------------------------------------------------

    def allocated(self, tag: int, size: int, handle: Any) -> None:
        frames = stack(sys._getframe(1))
        now = time.time_ns() // 1000
        if handle is not None:  # a block of the simulated allocator
            addr, block = handle.addr, handle.size
        else:
            addr, block = self._next_addr, size
            self._next_addr += max(size, 512)
            self.entries.append(("segment_alloc", addr, block, frames, now))
        self.entries.append(("alloc", addr, block, frames, now))
        self.live[tag] = [addr, block, size, frames]

    def resized(self, tag: int | None, old: int, new: int, handle: Any) -> None:
        if tag is not None and tag in self.live:
            self.freed(tag, old, None)
            self.allocated(tag, new, handle)

    def freed(self, tag: int | None, size: int, handle: Any) -> None:
        entry = self.live.pop(tag, None) if tag is not None else None
        now = time.time_ns() // 1000
        if entry is None:
            # A storage from before the test: its block may have merged with its neighbours
            # since (sim), or it never had an address here (cpu).
            return
        addr, block, _requested, frames = entry
        self.entries.append(("free_requested", addr, block, frames, now))
        self.entries.append(("free_completed", addr, block, frames, now))
        if self.segments is None:
            self.entries.append(("segment_free", addr, block, frames, now))

    def segment_event(self, action: str, addr: int, size: int) -> None:
        self.entries.append((action, addr, size, [], time.time_ns() // 1000))

    # -- the snapshot ---------------------------------------------------------------------

    def _frames(self, frames: list[Any]) -> list[dict[str, Any]]:
        names = self._names
        out = []
        for key in frames:
            named = names.get(key)
            if named is None:
                code, line = key
                named = names[key] = {
                    "filename": code.co_filename,
                    "line": line,
                    "name": code.co_name,
                }
            out.append(named)
        return out

    def snapshot(self, device: int = 0) -> dict[str, Any]:
        """The log as ``torch.cuda.memory._snapshot()`` would return it."""
        if self.segments is not None:
            extents = sorted(self.segments.segment_sizes.items())
        else:
            extents = sorted((addr, block) for addr, block, _r, _f in self.live.values())
        blocks_by_addr = sorted(tuple(entry) for entry in self.live.values())
        # The allocator's cached blocks tell its free space from blocks in use that were
        # allocated before the log began (which it has no stack for).
        cached_blocks = getattr(self.segments, "cached_blocks", None)
        cached = None if cached_blocks is None else sorted(cached_blocks())
        segments = []
        index = 0
        for start, size in extents:
            while index < len(blocks_by_addr) and blocks_by_addr[index][0] < start:
                index += 1
            blocks: list[dict[str, Any]] = []
            cursor = start
            allocated = requested_total = 0
            while index < len(blocks_by_addr) and blocks_by_addr[index][0] < start + size:
                addr, block, requested, frames = blocks_by_addr[index]
                if addr > cursor:
                    before = _between(cursor, addr, cached, blocks)
                    allocated += before
                    requested_total += before
                blocks.append(
                    {
                        "address": addr,
                        "size": block,
                        "requested_size": requested,
                        "state": "active_allocated",
                        "frames": self._frames(frames),
                    }
                )
                allocated += block
                requested_total += requested
                cursor = addr + block
                index += 1
            if cursor < start + size:
                before = _between(cursor, start + size, cached, blocks)
                allocated += before
                requested_total += before
            segments.append(
                {
                    "device": device,
                    "address": start,
                    "total_size": size,
                    "allocated_size": allocated,
                    "active_size": allocated,
                    "requested_size": requested_total,
                    "stream": 0,
                    "segment_type": "small" if size <= _SMALL_SEGMENT else "large",
                    "segment_pool_id": (0, 0),
                    "is_expandable": False,
                    "frames": [],
                    "blocks": blocks,
                }
            )
        trace = [
            {
                "action": action,
                "addr": addr,
                "size": size,
                "stream": 0,
                "time_us": when,
                "frames": self._frames(frames),
            }
            for action, addr, size, frames, when in self.entries
        ]
        traces: list[list[dict[str, Any]]] = [[] for _ in range(device + 1)]
        traces[device] = trace
        return {
            "segments": segments,
            "device_traces": traces,
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "expandable_segments": False},
        }


def _between(
    start: int, end: int, cached: list[tuple[int, int]] | None, blocks: list[dict[str, Any]]
) -> int:
    """Add the blocks from ``start`` to ``end``, where the log recorded none, to ``blocks``:
    the allocator's ``cached`` blocks are free, the rest is in use since before the log began.
    Without the allocator's cached blocks (None), all is free. Returns the bytes in use."""
    if cached is None:
        blocks.append(_inactive(start, end - start))
        return 0
    in_use = 0
    cursor = start
    for addr, size in cached[bisect_left(cached, (start, 0)) :]:
        if addr >= end:
            break
        if addr > cursor:
            blocks.append(_allocated_before(cursor, addr - cursor))
            in_use += addr - cursor
        blocks.append(_inactive(addr, size))
        cursor = addr + size
    if cursor < end:
        blocks.append(_allocated_before(cursor, end - cursor))
        in_use += end - cursor
    return in_use


def _allocated_before(addr: int, size: int) -> dict[str, Any]:
    return {
        "address": addr,
        "size": size,
        "requested_size": size,
        "state": "active_allocated",
        "frames": [],
    }


def _inactive(addr: int, size: int) -> dict[str, Any]:
    return {"address": addr, "size": size, "requested_size": 0, "state": "inactive", "frames": []}
