"""Where attribution sees allocations: a backend's own storage tracker, or one pushed for it.

The sim backend and the cpu backend's dispatch counter already see every op's outputs through a
:class:`~pytest_vram.backends.tracker.StorageTracker`; attribution attaches listeners to it.
The cpu backend's allocator counter and the cuda backend count elsewhere, so attribution pushes
a light dispatch mode of its own while it records (only then: it costs every op a Python call).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch only once attribution runs
    from pytest_vram.backends.base import Backend
    from pytest_vram.backends.tracker import StorageTracker

__all__ = ["TrackerSource"]


class TrackerSource:
    """The tracker that sees ``backend``'s allocations, while :meth:`open` to :meth:`close`.

    ``backend`` may be a test's view of a backend: each ability it asks passes through.
    """

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.tracker: StorageTracker | None = None
        self._pushed = False

    @property
    def available(self) -> bool:
        """Whether :meth:`open` finds a tracker: the backend's own, or one it can push."""
        backend = self.backend
        return backend.tracker is not None or backend.attribution_filter is not None

    def open(self) -> StorageTracker | None:
        if self.tracker is not None:
            return self.tracker
        tracker = self.backend.tracker
        if tracker is None:
            counts = self.backend.attribution_filter
            if counts is None:
                return None
            from pytest_vram.backends.tracker import StorageTracker

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
