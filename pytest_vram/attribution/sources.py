"""Where attribution sees allocations: a backend's own storage tracker, or one pushed for it.

The sim backend and the cpu backend's dispatch counter already see every op's outputs through a
:class:`~pytest_vram.backends.tracker.StorageTracker`; attribution attaches listeners to it.
The cpu backend's allocator counter and the cuda backend count elsewhere, so attribution pushes
a light dispatch mode of its own while it records (only then: it costs every op a Python call).
"""

from __future__ import annotations

import operator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only once attribution runs
    from pytest_vram.backends.base import Backend
    from pytest_vram.backends.tracker import StorageTracker

__all__ = ["TrackerSource", "unwrap"]

_is_cpu = operator.attrgetter("is_cpu")
_is_cuda = operator.attrgetter("is_cuda")


def unwrap(backend: Any) -> Backend:
    """The backend behind a test's own view of it."""
    return getattr(backend, "_backend", backend)


class TrackerSource:
    """The tracker that sees ``backend``'s allocations, while :meth:`open` to :meth:`close`."""

    def __init__(self, backend: Any) -> None:
        self.backend = unwrap(backend)
        self.tracker: StorageTracker | None = None
        self._pushed = False

    @property
    def own_tracker(self) -> StorageTracker | None:
        """The backend's own tracker, when it counts with one."""
        from pytest_vram.backends.tracker import StorageTracker

        tracker = getattr(self.backend, "tracker", None)
        if isinstance(tracker, StorageTracker):
            return tracker
        counter = getattr(self.backend, "counter", None)
        tracker = getattr(counter, "tracker", None)
        return tracker if isinstance(tracker, StorageTracker) else None

    def open(self) -> StorageTracker | None:
        if self.tracker is not None:
            return self.tracker
        tracker = self.own_tracker
        if tracker is None:
            name = self.backend.name
            if name not in ("cpu", "cuda"):
                return None
            from pytest_vram.backends.tracker import StorageTracker

            counts = _is_cpu if name == "cpu" else _is_cuda
            tracker = StorageTracker(counts=counts, count_unseen_aliases=False, adopt_unseen=True)
            tracker.mode.__enter__()
            self._pushed = True
        self.tracker = tracker
        return tracker

    def close(self) -> None:
        if self.tracker is not None and self._pushed:
            self.tracker.mode.__exit__(None, None, None)
        self.tracker = None
        self._pushed = False
