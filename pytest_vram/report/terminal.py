"""The ``--vram-report`` summary: an aligned table of the document's tests and a totals line.

Every gated test that needs a look (it failed, is new, or changed) gets a row; of the others
only the largest few do, so that a suite of thousands of plain tests reads in one screen. The
``--vram-json`` document has them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vram.record.record import TestRecord
from pytest_vram.record.status import FAILING_STATUSES, Status
from pytest_vram.report.document import (
    baseline_peak,
    build_document,
    document_tests,
    snapshot_of,
    status_counts,
)
from pytest_vram.report.ranks import rank_lines
from pytest_vram.report.text import change_text, counts_text, plural, size_text, table

__all__ = ["QUIET_ROWS", "render_terminal", "terminal_lines"]

#: How many rows the table gives the tests that need no look, largest peak first.
QUIET_ROWS = 20
_NOTABLE = FAILING_STATUSES | {Status.NEW.value, Status.IMPROVED.value}
_SKIPPED = Status.SKIPPED.value

_HEADER = ("test", "backend", "peak", "increment", "leftover", "baseline", "change", "status")
# The figures line up on their right edge.
_NUMBERS = frozenset(range(2, 7))


def terminal_lines(
    records: list[TestRecord], stale: list[str] | None = None, **more: Any
) -> list[str]:
    """The summary of a run's records: worst first, then by peak (see :func:`render_terminal`
    for ``more``)."""
    return render_terminal(build_document(records, {}), stale, **more)


def render_terminal(
    document: Mapping[str, Any],
    stale: list[str] | None = None,
    *,
    no_longer_opted_in: list[str] | None = None,
    not_measured: tuple[int, str] | None = None,
    all_in: str | None = None,
    quiet_rows: int = QUIET_ROWS,
) -> list[str]:
    """The summary lines of a document, in its order, and the stale baseline entries.

    ``stale`` entries have no test any more; ``no_longer_opted_in`` ones belong to tests that no
    longer opt in. ``not_measured`` is how many tests ran unmeasured, and why. ``all_in`` says
    where the rows left out are (the ``--vram-json`` path), None where no file has them.
    """
    every_test = document_tests(document)
    tests = [test for test in every_test if str(test.get("status") or "") in _NOTABLE]
    # A test skipped before it allocated anything has no figure to show; the totals count it.
    quiet = [
        test
        for test in every_test
        if str(test.get("status") or "") not in _NOTABLE
        and not (test.get("status") == _SKIPPED and not _peak(test))
    ]
    if len(quiet) > quiet_rows:
        quiet.sort(key=lambda test: -(_peak(test)))
    left_out, quiet = quiet[quiet_rows:], quiet[:quiet_rows]
    tests += quiet
    rows = [
        (
            str(test.get("nodeid") or ""),
            str(test.get("backend") or ""),
            size_text(test.get("peak_allocated")),
            size_text(test.get("peak_increment")),
            size_text(test.get("leftover")),
            size_text(baseline_peak(test)),
            change_text(test.get("change"), test.get("change_percent")),
            str(test.get("status") or ""),
        )
        for test in tests
    ]
    lines = table(_HEADER, rows, right=_NUMBERS)
    if left_out:
        where = f"all are in {all_in}" if all_in else "--vram-json PATH writes them all"
        lines.append(
            f"... and {plural(len(left_out), 'more test')} that passed, did not opt in or "
            f"skipped, smaller than those above; {where}"
        )
    lines += rank_lines(tests)
    measured, counts = status_counts(document)
    lines.append(plural(measured, "measured test") + (": " + counts_text(counts) if counts else ""))
    if not_measured is not None and not_measured[0]:
        count, why = not_measured
        lines.append(f"{plural(count, 'test')} not measured: {why}")
    lines += _snapshot_lines(tests)
    if no_longer_opted_in:
        entries = plural(len(no_longer_opted_in), "baseline entry", "baseline entries")
        verb, them = ("belongs", "it") if len(no_longer_opted_in) == 1 else ("belong", "them")
        lines.append(
            f"{entries} {verb} to tests that no longer opt in (no vram marker or fixture), "
            f"never compared (remove {them} with --vram-prune-baselines):"
        )
        lines.extend(f"  {nodeid}" for nodeid in no_longer_opted_in)
    if stale:
        entries = plural(len(stale), "baseline entry", "baseline entries")
        verb, them = ("has", "it") if len(stale) == 1 else ("have", "them")
        lines.append(
            f"{entries} {verb} no test any more (remove {them} with --vram-prune-baselines):"
        )
        lines.extend(f"  {nodeid}" for nodeid in stale)
    return lines


def _snapshot_lines(tests: list[Mapping[str, Any]]) -> list[str]:
    """Which file holds the memory snapshot of each failing test that has one."""
    return [
        f"memory snapshot of {test.get('nodeid') or ''}: {path}"
        for test in tests
        if (path := snapshot_of(test)) is not None
    ]


def _peak(test: Mapping[str, Any]) -> int:
    peak = test.get("peak_allocated")
    return peak if isinstance(peak, int) else 0
