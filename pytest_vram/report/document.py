"""The report document: the one model every report renders from.

:func:`build_document` turns the records of a run into the dict ``--vram-json`` writes. Its
``tests`` are rows made by :func:`record_row`, worst first; the terminal summary, the JUnit
properties, the Markdown and the HTML report all read these rows. The readers here
(:func:`document_tests`, :func:`baseline_peak`, :func:`status_counts`) also accept a document that
another tool wrote or trimmed, so a missing or odd value never breaks a report.
"""

from __future__ import annotations

import datetime
from collections import Counter
from collections.abc import Mapping
from typing import Any

from pytest_vram.record.record import TestRecord, sort_worst_first
from pytest_vram.record.status import Status, rank_of
from pytest_vram.report.text import as_int
from pytest_vram.version import __version__

__all__ = [
    "baseline_peak",
    "build_document",
    "change_of",
    "document_tests",
    "record_row",
    "snapshot_of",
    "status_counts",
    "totals",
]


def change_of(record: TestRecord) -> tuple[int | None, float | None]:
    """Peak against the baseline's peak: bytes and percent, None without a baseline."""
    if not record.baseline or "peak_allocated" not in record.baseline:
        return None, None
    base = record.baseline["peak_allocated"]
    delta = record.peak_allocated - base
    return delta, (100.0 * delta / base if base else None)


def record_row(record: TestRecord) -> dict[str, Any]:
    """One test of the document: the record's fields and figures, and its change."""
    row = record.to_dict()
    row["change"], row["change_percent"] = change_of(record)
    return row


def totals(records: list[TestRecord]) -> dict[str, int]:
    """``measured``, then the count of each status that occurs, worst first."""
    counts = Counter(record.status for record in records)
    result = {"measured": len(records)}
    result.update({s.value: counts[s.value] for s in Status if counts[s.value]})
    return result


def build_document(
    records: list[TestRecord],
    environments: dict[str, dict[str, Any]],
    run: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The JSON document: the one source every report renders from.

    ``run`` says what a baseline update from the document needs to know about the run
    (``pytest-vram update-baselines``): ``measured`` (``all`` or ``marked``) and ``stale``.
    """
    document = {
        "pytest_vram": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environments": environments,
        "totals": totals(records),
        "tests": [record_row(record) for record in sort_worst_first(records)],
    }
    if run is not None:
        document["run"] = dict(run)
    return document


def document_tests(document: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The document's tests, in its order; entries that are not mappings are left out."""
    # type() first: a document's tests are dicts, and an ABC check costs more.
    return [
        test
        for test in document.get("tests") or []
        if type(test) is dict or isinstance(test, Mapping)
    ]


def baseline_peak(test: Mapping[str, Any]) -> int | None:
    """The peak allocated of a test's baseline entry, None without one."""
    baseline = test.get("baseline")
    if baseline is None:  # most tests, without the ABC check
        return None
    return as_int(baseline.get("peak_allocated")) if isinstance(baseline, Mapping) else None


def snapshot_of(test: Mapping[str, Any]) -> str | None:
    """The memory snapshot file written for a failing test, None without one."""
    path = test.get("snapshot")
    return path if isinstance(path, str) and path else None


def status_counts(document: Mapping[str, Any]) -> tuple[int, dict[str, int]]:
    """The measured count and the non-zero count of each status, worst first.

    Read from the document's ``totals`` (keyed by status, plus ``measured``); counted from its
    tests when it has none. A key that is no status is kept, after every status.
    """
    counted = document.get("totals")
    # The tests are read only where the totals leave something out.
    if not isinstance(counted, Mapping):
        tests = document_tests(document)
        counted = {"measured": len(tests)}
        for test in tests:
            status = str(test.get("status") or "")
            counted[status] = counted.get(status, 0) + 1
    measured = counted.get("measured")
    measured = len(document_tests(document)) if measured is None else as_int(measured) or 0
    counts = {}
    for key, value in counted.items():
        count = as_int(value)
        if key != "measured" and key and count:
            counts[str(key)] = count
    ordered = sorted(counts, key=rank_of)
    return measured, {key: counts[key] for key in ordered}
