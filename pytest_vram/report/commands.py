"""The ``summary`` and ``compare`` subcommands of ``pytest-vram``: a run's memory table, and two
runs compared, from JUnit XML files or ``--vram-json`` documents.

Exit statuses: ``compare`` exits 1 when a test grew beyond the tolerance; input it cannot use is
a :class:`~pytest_vram.report.junitfile.JUnitFileError` (or a shard error), which the command
turns into exit status 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from pytest_vram.errors import UsageError
from pytest_vram.record.status import rank_of
from pytest_vram.report.comparison import render_comparison
from pytest_vram.report.jsonfile import (
    is_json_report,
    junit_name,
    read_json_report,
    read_report,
    read_reports,
)
from pytest_vram.report.junitfile import JUnitFileError, MemoryTable
from pytest_vram.report.peakchange import add_lines, explanation_lines, flagged_tests
from pytest_vram.report.runcomparison import RunComparison, compare_runs
from pytest_vram.report.text import as_int, change_text, environment_line, plural, size_text
from pytest_vram.report.text import table as table_lines
from pytest_vram.units import SizeError, Tolerance, parse_tolerance

__all__ = ["add_cli_parsers"]

_NO_PROPERTIES_HINT = (
    "run pytest with --junitxml and --vram-report (or a vram marker or fixture), "
    "and without --vram-junit-properties=no"
)


def add_cli_parsers(subcommands: Any) -> None:
    """Add ``summary`` and ``compare`` to the ``pytest-vram`` command."""
    summary = subcommands.add_parser(
        "summary",
        help="print the memory table of a run (a JUnit XML file or a --vram-json document)",
        description=(
            "Print the memory figures pytest-vram recorded in a JUnit XML file written with "
            "--junitxml or in a document written with --vram-json."
        ),
    )
    summary.add_argument(
        "file",
        metavar="FILE",
        help="a JUnit XML file written by pytest --junitxml, or a --vram-json document",
    )
    summary.set_defaults(run=_run_summary)

    comparison = subcommands.add_parser(
        "compare",
        help="compare the memory of two runs (JUnit XML files or --vram-json documents)",
        description=(
            "Compare each test's peak allocated memory between two runs, each a JUnit XML "
            "file written with --junitxml or a document written with --vram-json (one of "
            "each also works). Exit status 1 when a test grew beyond the tolerance, else 0."
        ),
    )
    comparison.add_argument(
        "base", metavar="BASE", help="the JUnit XML or --vram-json file of the reference run"
    )
    comparison.add_argument(
        "head", metavar="HEAD", help="the JUnit XML or --vram-json file of the new run"
    )
    comparison.add_argument(
        "--tolerance",
        default="5%",
        type=_tolerance,
        metavar="TOL",
        help="growth allowed: a percentage of the base peak (5%%) or a size (64MiB); default 5%%",
    )
    comparison.add_argument(
        "--markdown",
        action="store_true",
        help="print the changes as Markdown for a pull-request comment; nothing when none",
    )
    comparison.add_argument(
        "--base-lines",
        metavar="FILE",
        help="a --vram-json document of a second pass on the base (--vram-peak-lines=all over "
        "the tests `pytest-vram flagged HEAD` lists): its peak lines join the base's",
    )
    comparison.set_defaults(run=_run_compare)

    flagged = subcommands.add_parser(
        "flagged",
        help="list the tests a --vram-json document flagged, for a second pass on the base",
        description=(
            "Print the node ids of the gated tests a --vram-json document flagged (failed a "
            "memory check, or carries the lines alive at its peak), one per line, as a file "
            "pytest reads with @FILE. A node id that is not a plain relative path::name is "
            "left out, so a crafted report cannot pass pytest an option."
        ),
    )
    flagged.add_argument("report", metavar="REPORT", help="a --vram-json document")
    flagged.set_defaults(run=_run_flagged)


def _tolerance(text: str) -> Tolerance:
    try:
        return parse_tolerance(text)
    except SizeError as exc:
        raise UsageError(f"--tolerance: {exc}") from None


def _run_summary(args: argparse.Namespace) -> int:
    table = read_report(args.file)
    print(_summary_text(table), end="")
    return 0


def _summary_text(table: MemoryTable) -> str:
    lines = []
    for env in table.environments:
        lines.append("environment: " + _describe_env(env))
    if lines:
        lines.append("")
    if not table.rows:
        lines.append(
            f"{table.path}: none of its {plural(table.total, 'test')} carries vram "
            f"properties; {_NO_PROPERTIES_HINT}"
        )
        return "\n".join(lines) + "\n"
    rows = sorted(
        table.rows,
        key=lambda r: (
            rank_of(str(r.get("vram_status"))),
            -(as_int(r.get("vram_peak_allocated")) or 0),
            r["name"],
        ),
    )
    body = [
        [
            row["name"],
            str(row.get("vram_backend", "")),
            size_text(row.get("vram_peak_allocated")),
            size_text(row.get("vram_baseline")),
            str(row.get("vram_status", "")),
        ]
        for row in rows
    ]
    lines += table_lines(["test", "backend", "peak", "baseline", "status"], body, right={2, 3})
    lines.append("")
    measured = len(table.rows)
    line = plural(measured, "measured test")
    skipped = table.total - measured
    if skipped:
        line += f"; {plural(skipped, 'test')} without vram properties not shown"
    counts: dict[str, int] = {}
    for row in rows:
        status = str(row.get("vram_status", ""))
        counts[status] = counts.get(status, 0) + 1
    if counts:
        line += " (" + ", ".join(f"{n} {s}" for s, n in counts.items() if s) + ")"
    lines.append(line + ".")
    return "\n".join(lines) + "\n"


def _run_compare(args: argparse.Namespace) -> int:
    base, head = read_reports(args.base, args.head)
    if not head.rows:
        raise JUnitFileError(
            f"{head.path}: none of its {plural(head.total, 'test')} carries vram "
            f"properties, so there is nothing to compare; {_NO_PROPERTIES_HINT}"
        )
    if args.base_lines:
        extra = read_report(args.base_lines).rows
        if is_json_report(args.base_lines) and not is_json_report(args.base):
            for row in extra:  # named as the JUnit base names its tests
                row["name"] = junit_name(row["name"])
        add_lines(base.rows, extra)
    result = compare_runs(base.rows, head.rows, args.tolerance)
    if args.markdown:
        print(render_comparison(result, base.rows, head.rows), end="")
    else:
        print(_compare_text(base, head, result), end="")
    return 1 if result.failed else 0


def _run_flagged(args: argparse.Namespace) -> int:
    for nodeid in flagged_tests(read_json_report(args.report).rows):
        print(nodeid)
    return 0


def _compare_text(base: MemoryTable, head: MemoryTable, result: RunComparison) -> str:
    lines = [
        f"base: {base.path} ({plural(len(base.rows), 'measured test')})",
        f"head: {head.path} ({plural(len(head.rows), 'measured test')})",
        f"tolerance: {result.tolerance}",
    ]
    if not base.rows:
        lines.append(f"note: {base.path} carries no vram properties; every test counts as new")
    base_devices, head_devices = _devices(base.rows), _devices(head.rows)
    if base.rows and base_devices != head_devices:
        lines.append(
            f"note: measured on different devices: base {', '.join(base_devices) or '?'}, "
            f"head {', '.join(head_devices) or '?'}"
        )
    lines.append("")
    shown = [c for c in result.changes if c.kind != "unchanged"]
    if shown:
        body = [
            [
                change.name,
                size_text(change.base),
                size_text(change.head),
                change_text(change.delta, change.percent, missing=""),
                change.kind,
            ]
            for change in shown
        ]
        lines += table_lines(["test", "base", "head", "change", "result"], body, right={1, 2, 3})
        lines.append("")
    lines += explanation_lines(result.beyond, base.rows, head.rows)
    parts = [f"{count} {words}" for _, count, words in result.counts()]
    lines.append((", ".join(parts) or "no measured tests") + ".")
    if result.failed:
        count = len(result.grown)
        lines.append(
            f"FAILED: {plural(count, 'test')} grew beyond the tolerance ({result.tolerance})."
        )
    return "\n".join(lines) + "\n"


def _devices(rows: list[dict[str, Any]]) -> list[str]:
    return sorted({str(r["vram_device"]) for r in rows if "vram_device" in r})


def _describe_env(env: dict[str, Any]) -> str:
    backend = str(env.get("backend", "?"))
    device = str(env.get("device", ""))
    # The sim and cpu backends name their device after themselves: "sim", not "sim, sim".
    facts = environment_line({**env, "device": "" if device == backend else device})
    return ", ".join(part for part in (backend, facts) if part)
