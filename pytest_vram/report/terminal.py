"""The ``--vram-report`` summary: an aligned table of the document's tests and a totals line."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vram.record.record import TestRecord
from pytest_vram.report.document import (
    baseline_peak,
    build_document,
    document_tests,
    snapshot_of,
    status_counts,
)
from pytest_vram.report.ranks import rank_lines
from pytest_vram.report.text import change_text, counts_text, plural, size_text, table

__all__ = ["render_terminal", "terminal_lines"]

_HEADER = ("test", "backend", "peak", "increment", "leftover", "baseline", "change", "status")
# The figures line up on their right edge.
_NUMBERS = frozenset(range(2, 7))


def terminal_lines(records: list[TestRecord], stale: list[str] | None = None) -> list[str]:
    """The summary of a run's records: worst first, then by peak."""
    return render_terminal(build_document(records, {}), stale)


def render_terminal(document: Mapping[str, Any], stale: list[str] | None = None) -> list[str]:
    """The summary lines of a document, in its order, and the stale baseline entries."""
    tests = document_tests(document)
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
    lines += rank_lines(tests)
    measured, counts = status_counts(document)
    lines.append(plural(measured, "measured test") + (": " + counts_text(counts) if counts else ""))
    lines += _snapshot_lines(tests)
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
