"""Renderings of the records: the terminal summary, JUnit properties and the JSON document."""

from __future__ import annotations

import datetime
from collections import Counter
from typing import Any

from pytest_vram import __version__
from pytest_vram.records import STATUS_ORDER, TestRecord, sort_worst_first
from pytest_vram.units import format_delta, format_size

__all__ = ["build_document", "junit_properties", "terminal_lines", "totals"]


def change_of(record: TestRecord) -> tuple[int | None, float | None]:
    """Peak against the baseline's peak: bytes and percent, None without a baseline."""
    if not record.baseline or "peak_allocated" not in record.baseline:
        return None, None
    base = record.baseline["peak_allocated"]
    delta = record.peak_allocated - base
    return delta, (100.0 * delta / base if base else None)


def totals(records: list[TestRecord]) -> dict[str, int]:
    counts = Counter(record.status for record in records)
    result = {"measured": len(records)}
    result.update({status: counts[status] for status in STATUS_ORDER if counts[status]})
    return result


def describe_totals(records: list[TestRecord]) -> str:
    counts = totals(records)
    measured = counts.pop("measured")
    parts = [f"{count} {status}" for status, count in counts.items()]
    noun = "test" if measured == 1 else "tests"
    return f"{measured} measured {noun}" + (": " + ", ".join(parts) if parts else "")


def _change_text(record: TestRecord) -> str:
    delta, percent = change_of(record)
    if delta is None:
        return "-"
    return format_delta(delta) + ("" if percent is None else f" ({percent:+.1f}%)")


def terminal_lines(records: list[TestRecord], stale: list[str] | None = None) -> list[str]:
    """The ``--vram-report`` table: worst first, then by peak."""
    header = ("test", "backend", "peak", "increment", "leftover", "baseline", "change", "status")
    rows = [header]
    for record in sort_worst_first(records):
        baseline = (record.baseline or {}).get("peak_allocated")
        rows.append(
            (
                record.nodeid,
                record.backend,
                format_size(record.peak_allocated),
                format_size(record.peak_increment),
                format_size(record.leftover),
                "-" if baseline is None else format_size(baseline),
                _change_text(record),
                record.status,
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = []
    for row in rows:
        cells = [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
        cells += [cell.rjust(width) for cell, width in zip(row[2:7], widths[2:7], strict=True)]
        cells.append(row[7])
        lines.append("  ".join(cells).rstrip())
    lines.append(describe_totals(records))
    if stale:
        count = len(stale)
        entries = "1 baseline entry has" if count == 1 else f"{count} baseline entries have"
        lines.append(f"{entries} no test any more (remove them with --vram-prune-baselines):")
        lines.extend(f"  {nodeid}" for nodeid in stale)
    return lines


def junit_properties(record: TestRecord) -> list[tuple[str, object]]:
    """The ``vram_*`` properties of one test: sizes as integer bytes."""
    props: list[tuple[str, object]] = [
        ("vram_backend", record.backend),
        ("vram_device", record.device),
        ("vram_peak_allocated", record.peak_allocated),
    ]
    if record.baseline and "peak_allocated" in record.baseline:
        props.append(("vram_baseline", record.baseline["peak_allocated"]))
    props += [
        ("vram_status", record.status),
        ("vram_start_allocated", record.start_allocated),
        ("vram_peak_increment", record.peak_increment),
        ("vram_leftover", record.leftover),
    ]
    if record.peak_reserved is not None:
        props.append(("vram_peak_reserved", record.peak_reserved))
    if record.peak_device is not None:
        props.append(("vram_peak_device", record.peak_device))
    leak = record.scenarios.get("leak_check")
    if leak:
        props.append(("vram_leak_growth", leak["growth"]))
    return props


def build_document(
    records: list[TestRecord], environments: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """The JSON document: the one source the Markdown and HTML reports render from."""
    tests = []
    for record in sort_worst_first(records):
        data = record.to_dict()
        data["change"], data["change_percent"] = change_of(record)
        tests.append(data)
    return {
        "pytest_vram": __version__,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environments": environments,
        "totals": totals(records),
        "tests": tests,
    }
