"""Memory snapshots of failing tests in PyTorch's format, for ``torch.cuda._memory_viz``.

On cuda the allocator records its own history (``torch.cuda.memory._record_memory_history``)
and ``torch.cuda.memory._dump_snapshot`` writes it. On sim and cpu a
:class:`~pytest_vram.attribution.trace.TraceLog` listens to the storage tracker while each test
runs and writes the same dict: the simulated allocator's segments and blocks on sim, one
segment per storage on cpu, and a trace of every allocation and free with its Python stack.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

from pytest_vram.backends.base import Backend

__all__ = ["SnapshotRecorder", "history_recording", "resume_history"]

# Enough history to see a training step's allocations without slowing the allocator much.
_MAX_ENTRIES = 100_000
# Whether a recorder keeps the CUDA allocator's history on (a leak check's sites turn it on
# for their steps, and back to this when they are done).
_CUDA_HISTORY = {"on": False}


def history_recording() -> bool:
    """Whether the CUDA allocator's history is being recorded for snapshots."""
    return _CUDA_HISTORY["on"]


def resume_history() -> None:
    """Turn the snapshots' recording of the CUDA allocator's history back on."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=_MAX_ENTRIES)


def _file_name(nodeid: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_") + ".pickle"


class SnapshotRecorder:
    """Records allocations while tests run and dumps a snapshot when one fails."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._recording = False
        self._log: Any = None
        self._source: Any = None
        self._segments: Any = None

    def start(self, backend: Backend) -> None:
        if self.directory is None:
            return
        from pytest_vram.attribution.sources import unwrap

        if unwrap(backend).name == "cuda":
            if not self._recording:
                import torch

                torch.cuda.memory._record_memory_history(max_entries=_MAX_ENTRIES)
                self._recording = True
                _CUDA_HISTORY["on"] = True
            return
        self._start_log(unwrap(backend))

    def _start_log(self, backend: Backend) -> None:
        from pytest_vram.attribution.sources import TrackerSource
        from pytest_vram.attribution.trace import TraceLog

        self.stop()
        source = TrackerSource(backend)
        tracker = source.open()
        if tracker is None:
            return
        segments = getattr(backend, "segments", None)
        self._log = TraceLog(segments if hasattr(segments, "segment_sizes") else None)
        if self._log.segments is not None:
            self._segments = self._log.segments
            self._segments.segment_listener = self._log.segment_event
        tracker.add_listener(self._log)
        self._source = source

    def stop(self) -> None:
        """The test is over: stop listening (on sim and cpu; cuda records on)."""
        if self._source is not None:
            tracker = self._source.tracker
            if tracker is not None:
                tracker.remove_listener(self._log)
            self._source.close()
            self._source = None
        if self._segments is not None:
            self._segments.segment_listener = None
            self._segments = None

    def snapshot(self) -> dict[str, Any] | None:
        """What the log of the running test holds, as ``torch.cuda.memory._snapshot()``."""
        if self._log is None or self._source is None:
            return None
        if self._source.tracker is not None:
            self._source.tracker.flush()
        return self._log.snapshot()

    def dump(self, backend: Backend, nodeid: str) -> Path | None:
        if self.directory is None:
            return None
        from pytest_vram.attribution.sources import unwrap

        name = unwrap(backend).name
        if name == "cuda":
            if not self._recording:
                return None
            self.directory.mkdir(parents=True, exist_ok=True)
            path = self.directory / _file_name(nodeid)
            import torch

            torch.cuda.memory._dump_snapshot(str(path))
            return path
        snapshot = self.snapshot()
        if snapshot is None:
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / _file_name(nodeid)
        with open(path, "wb") as file:
            pickle.dump(snapshot, file)
        return path

    def notes(self) -> list[str]:
        return []
