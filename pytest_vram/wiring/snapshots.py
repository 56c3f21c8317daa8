"""Memory snapshots of failing tests in PyTorch's format, for ``torch.cuda._memory_viz``.

On cuda the allocator records its own history (``torch.cuda.memory._record_memory_history``)
and ``torch.cuda.memory._snapshot`` reads it. On sim and cpu a
:class:`~pytest_vram.backends.tracelog.TraceLog` listens to the storage tracker while each test
runs and writes the same dict: the simulated allocator's segments and blocks on sim, one
segment per storage on cpu, and a trace of every allocation and free with its Python stack.

Each test's file is named by :func:`snapshot_name`; the path written lands in the test's record,
so every report names the file of that test.
"""

from __future__ import annotations

import hashlib
import pickle
import re
from pathlib import Path
from typing import Any

from pytest_vram.atomic import temporary_prefix, write_atomic
from pytest_vram.backends.base import Backend
from pytest_vram.backends.cuda.history import resume_history

__all__ = ["SnapshotError", "SnapshotRecorder", "snapshot_name"]

# A name keeps this much of the test id: with the hash and the suffix it stays far below the
# 255 bytes a file name may have, however long the id (parametrize ids have no limit).
_SLUG_CHARS = 100
_HASH_CHARS = 12
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def snapshot_name(nodeid: str) -> str:
    """The file name of the snapshot of the test ``nodeid``: the id made safe for a file name
    and cut short, for reading, then a hash of the whole id, for telling ids apart that read
    alike once made safe (``a/b``, ``a:b`` and ``a b``) or once cut. ASCII, at most 120 bytes.
    """
    # No leading dot (a hidden file) or dash (read as an option by memory_viz's command line).
    slug = _UNSAFE.sub("_", nodeid)[:_SLUG_CHARS].strip("_.-") or "test"
    digest = hashlib.sha256(nodeid.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{slug}-{digest[:_HASH_CHARS]}.pickle"


def _reason(exc: Exception, path: Path) -> str:
    """Why ``path`` was not written, on one line: the error, and the file at fault when it is
    another (a file where the directory should be)."""
    if isinstance(exc, OSError) and exc.strerror:
        named = exc.filename
        # The temporary file beside the target is no name the user knows.
        if named is None or Path(named).name.startswith(temporary_prefix(path)):
            named = path
        return exc.strerror if Path(named) == path else f"{named}: {exc.strerror}"
    message = " ".join(str(exc).split())
    return type(exc).__name__ + (f": {message}" if message else "")


class SnapshotError(Exception):
    """A snapshot that could not be written: one line naming the test and the reason. The
    test's own failure stays the one reported."""


class SnapshotRecorder:
    """Records allocations while tests run and dumps a snapshot when one fails."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        #: Whether the CUDA allocator's history is recorded for the running test.
        self._recording = False
        #: Why it is not, where the allocator records none.
        self._cuda_note: str | None = None
        self._log: Any = None
        self._source: Any = None
        self._segments: Any = None

    def start(self, backend: Backend) -> None:
        if self.directory is None:
            return
        if backend.memory_history:
            # Cleared for each test: a failing test's snapshot holds its own history, not the
            # session's.
            self._cuda_note = backend.snapshot_note
            self._recording = self._cuda_note is None
            if self._recording:
                resume_history(clear=True)
            return
        self._start_log(backend)

    def _start_log(self, backend: Backend) -> None:
        from pytest_vram.attribution.sources import TrackerSource
        from pytest_vram.backends.tracelog import TraceLog

        self.stop()
        source = TrackerSource(backend)
        tracker = source.open()
        if tracker is None:
            return
        self._log = TraceLog(backend.segments)
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
        """Write the snapshot of the failing test ``nodeid``; its path, or None when nothing
        was recorded. Raises :class:`SnapshotError` when it cannot be written: an earlier
        file of the test is then left as it was."""
        if self.directory is None:
            return None
        path = self.directory / snapshot_name(nodeid)
        if self._cuda_note is not None and backend.memory_history:
            raise SnapshotError(f"no memory snapshot of {nodeid}: {self._cuda_note}")
        try:
            snapshot = self._take(backend)
            if snapshot is None:
                return None
            write_atomic(path, pickle.dumps(snapshot))
        except Exception as exc:  # whatever it is, the test's failure must stay the one shown
            raise SnapshotError(
                f"no memory snapshot of {nodeid}: cannot write {path} ({_reason(exc, path)})"
            ) from None
        return path

    def _take(self, backend: Backend) -> dict[str, Any] | None:
        if backend.memory_history:
            if not self._recording:
                return None
            import torch

            # What torch.cuda.memory._dump_snapshot writes, written whole by write_atomic.
            return torch.cuda.memory._snapshot()
        return self.snapshot()

    def notes(self) -> list[str]:
        return []
