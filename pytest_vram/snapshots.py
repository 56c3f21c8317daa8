"""Allocator snapshots of failing tests, for PyTorch's memory_viz (cuda only)."""

from __future__ import annotations

import re
from pathlib import Path

from pytest_vram.backends.base import Backend

__all__ = ["SnapshotRecorder"]

# Enough history to see a training step's allocations without slowing the allocator much.
_MAX_ENTRIES = 100_000


class SnapshotRecorder:
    """Records the CUDA allocator's history while tests run and dumps it when one fails."""

    def __init__(self, directory: Path | None) -> None:
        self.directory = directory
        self._recording = False
        self._without_history: set[str] = set()

    def start(self, backend: Backend) -> None:
        if self.directory is None:
            return
        if backend.name != "cuda":
            self._without_history.add(backend.name)
            return
        if not self._recording:
            import torch

            torch.cuda.memory._record_memory_history(max_entries=_MAX_ENTRIES)
            self._recording = True

    def dump(self, backend: Backend, nodeid: str) -> Path | None:
        if self.directory is None or not self._recording or backend.name != "cuda":
            return None
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / (re.sub(r"[^A-Za-z0-9_.-]+", "_", nodeid).strip("_") + ".pickle")
        import torch

        torch.cuda.memory._dump_snapshot(str(path))
        return path

    def notes(self) -> list[str]:
        if not self._without_history:
            return []
        names = ", ".join(sorted(self._without_history))
        return [
            "--vram-snapshot-on-fail: allocator snapshots exist only on the cuda backend; "
            f"none were recorded for tests measured on {names}"
        ]
