"""Two runs' memory compared, test by test: what ``pytest-vram compare`` decides.

A test grew when its peak allocated in the head run exceeds the base run's by more than the
tolerance. Only gated tests are compared: a test reported ``ungated`` (it did not opt in, and the
run gated only the tests that did) is left out on both sides, as its run never compared it with
a baseline either. The rows come from :mod:`pytest_vram.report.junitfile` or
:mod:`pytest_vram.report.jsonfile`, and :mod:`pytest_vram.report.comparison` renders the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_vram.units import Tolerance, parse_tolerance

__all__ = ["PeakChange", "RunComparison", "compare_runs"]


@dataclass
class PeakChange:
    """One test's peak allocated in the base run and in the head run."""

    name: str
    #: grown (beyond the tolerance), within-tolerance, shrunk, unchanged, new or removed.
    kind: str
    base: int | None
    head: int | None
    #: Whether the peak moved by more than the tolerance, either way: the changes that
    #: ``compare`` explains (categories, modules and lines at the peak).
    beyond: bool = False

    @property
    def delta(self) -> int | None:
        if self.base is None or self.head is None:
            return None
        return self.head - self.base

    @property
    def percent(self) -> float | None:
        if self.delta is None or not self.base:
            return None
        return 100.0 * self.delta / self.base


_KIND_ORDER = ("grown", "within-tolerance", "shrunk", "new", "removed", "unchanged")


@dataclass
class RunComparison:
    """Per-test changes of ``vram_peak_allocated`` between two JUnit files."""

    tolerance: Tolerance
    changes: list[PeakChange] = field(default_factory=list)

    def of_kind(self, kind: str) -> list[PeakChange]:
        return [c for c in self.changes if c.kind == kind]

    @property
    def grown(self) -> list[PeakChange]:
        """Tests that grew beyond the tolerance: these fail the comparison."""
        return self.of_kind("grown")

    @property
    def beyond(self) -> list[PeakChange]:
        """Tests whose peak moved by more than the tolerance, grown or shrunk."""
        return [c for c in self.changes if c.beyond]

    @property
    def failed(self) -> bool:
        return bool(self.grown)

    def counts(self) -> list[tuple[str, int, str]]:
        """``(kind, count, words)`` for each kind of change that some test has, in the order
        reports list them (``unchanged`` last)."""
        labels = (
            ("grown", f"grown beyond {self.tolerance}"),
            ("within-tolerance", "grown within the tolerance"),
            ("shrunk", "shrunk"),
            ("new", "new"),
            ("removed", "removed"),
            ("unchanged", "unchanged"),
        )
        found = ((kind, len(self.of_kind(kind)), words) for kind, words in labels)
        return [(kind, count, words) for kind, count, words in found if count]


def compare_runs(
    base_rows: list[dict[str, Any]],
    head_rows: list[dict[str, Any]],
    tolerance: str | Tolerance = "5%",
) -> RunComparison:
    """Compare each test's ``vram_peak_allocated`` between two memory tables.

    A test grew when its head peak exceeds its base peak by more than the tolerance (a
    percentage of the base peak, or a size). Tests are matched by name; when a name appears
    more than once in a file, its largest peak counts. Raises :class:`SizeError` for a bad
    tolerance.
    """
    tolerance = parse_tolerance(tolerance)
    base, head = _peaks(base_rows), _peaks(head_rows)
    changes = []
    for name in sorted(base.keys() | head.keys()):
        before, after = base.get(name), head.get(name)
        if before is None:
            kind = "new"
        elif after is None:
            kind = "removed"
        elif after - before > tolerance.allowance(before):
            kind = "grown"
        elif after > before:
            kind = "within-tolerance"
        elif after < before:
            kind = "shrunk"
        else:
            kind = "unchanged"
        beyond = (
            before is not None
            and after is not None
            and abs(after - before) > tolerance.allowance(before)
        )
        changes.append(PeakChange(name=name, kind=kind, base=before, head=after, beyond=beyond))
    changes.sort(key=lambda c: (_KIND_ORDER.index(c.kind), -abs(c.delta or 0), c.name))
    return RunComparison(tolerance=tolerance, changes=changes)


_UNGATED = "ungated"


def _peaks(rows: list[dict[str, Any]]) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for row in rows:
        if row.get("vram_status") == _UNGATED:
            continue
        peak = row.get("vram_peak_allocated")
        if isinstance(peak, int) and not isinstance(peak, bool):
            name = str(row.get("name"))
            peaks[name] = max(peak, peaks.get(name, peak))
    return peaks
