"""The lines of the user's code that allocated what was alive at a test's peak.

Taken on a rerun of a test that failed or regressed (see :mod:`pytest_vram.wiring.peaklines`),
so a passing test pays nothing. While it runs, the breakdown's listener logs every allocation
and free, and each allocation also notes its site: the innermost frame of the user's code,
frames of torch, pytest, pluggy, this plugin and installed libraries skipped, as leak sites
are found (:mod:`pytest_vram.attribution.callsites`). When the call ends the log is replayed
to its peak, and the storages alive then are summed by site and category. On every backend:
the sim backend and the cpu dispatch counter have a tracker, and one is pushed for the cpu
allocator counter and for cuda (:class:`~pytest_vram.attribution.sources.TrackerSource`).
"""

from __future__ import annotations

import linecache
import os
import sys
from typing import TYPE_CHECKING, Any

from pytest_vram.attribution.breakdown import PeakBreakdown, by_place
from pytest_vram.attribution.callsites import Site, user_frames
from pytest_vram.attribution.sources import TrackerSource

if TYPE_CHECKING:
    from pytest_vram.backends.base import Backend

__all__ = ["SHOWN_LINES", "PeakLineRecorder"]

#: How many lines a record keeps, largest first: enough that a line which grew past others
#: is found on both sides of a comparison.
SHOWN_LINES = 10
# The text of a line is cut here: a report shows it on one line.
_TEXT_CHARS = 160


class _SiteLog(PeakBreakdown):
    """The breakdown's log, with the site of each allocation."""

    def __init__(self, tracker: Any) -> None:
        super().__init__(tracker, modules=False)
        self.sites: dict[int, Site] = {}

    def allocated(self, tag: int, size: int, handle: Any) -> None:
        super().allocated(tag, size, handle)
        # Two frames up is the tracker; the walk skips it and torch's frames below the user's.
        found = user_frames(1, sys._getframe(1))
        if found:
            self.sites[tag] = found[0]


class PeakLineRecorder:
    """Records one test's call on ``backend`` from :meth:`start` to :meth:`stop`."""

    def __init__(self, backend: Backend, root: str | os.PathLike[str] | None = None) -> None:
        self.source = TrackerSource(backend)
        self.root = os.fspath(root) if root is not None else os.getcwd()
        self._log: _SiteLog | None = None

    @property
    def available(self) -> bool:
        return self.source.available

    def start(self) -> bool:
        tracker = self.source.open()
        if tracker is None:
            return False
        self._log = _SiteLog(tracker)
        self._log.start()
        return True

    def stop(self, shown: int = SHOWN_LINES) -> list[dict[str, Any]]:
        """The lines alive at the peak, largest first: ``file`` (relative to the root),
        ``line``, ``text``, ``bytes`` and ``category``; one entry per line and category."""
        log, self._log = self._log, None
        if log is None:
            return []
        try:
            log.tracker.flush()
            live = log._live_at_peak()
            known = log.known
            sites = log.sites
            totals: dict[tuple[Site, str], int] = {}
            for tag, size, place in live:
                site = sites.get(tag)
                if site is None or not size:
                    continue  # allocated before the call, or by no line of the user's
                category = (known.get(tag) or by_place(place))[0]
                key = (site, category)
                totals[key] = totals.get(key, 0) + size
        finally:
            log.stop()
            self.source.close()
        ranked = sorted(totals.items(), key=lambda item: (-item[1], item[0]))[:shown]
        return [self._entry(site, category, size) for (site, category), size in ranked]

    def _entry(self, site: Site, category: str, size: int) -> dict[str, Any]:
        filename, line, _function = site
        text = " ".join(linecache.getline(filename, line).split())
        if len(text) > _TEXT_CHARS:
            text = text[: _TEXT_CHARS - 1] + "…"
        return {
            "file": _relative(filename, self.root),
            "line": line,
            "text": text,
            "bytes": size,
            "category": category,
        }


def _relative(filename: str, root: str) -> str:
    try:
        rel = os.path.relpath(filename, root)
    except ValueError:  # another drive
        return filename
    return filename if rel.startswith(".." + os.sep) else rel.replace(os.sep, "/")
