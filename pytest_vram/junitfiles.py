"""Memory figures in JUnit XML files: ``pytest-vram summary`` and ``pytest-vram compare``.

pytest's ``--junitxml`` report carries each measured test's figures as ``vram_*`` properties
(sizes in integer bytes) and the environment as ``vram_env_*`` suite properties. These commands
read them back, so CI can print or compare memory without the JSON report.
"""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass, field
from typing import Any
from xml.etree import ElementTree

from junitparser import JUnitXml, JUnitXmlError, Properties

from pytest_vram.errors import UsageError
from pytest_vram.figures import FigureError, figure_from_text, is_known_figure
from pytest_vram.report.comparison import render_comparison
from pytest_vram.report.text import (
    as_int,
    change_text,
    environment_line,
    plural,
    size_text,
)
from pytest_vram.report.text import table as table_lines
from pytest_vram.status import rank_of
from pytest_vram.units import SizeError, Tolerance, parse_tolerance

__all__ = [
    "JUnitFileError",
    "MemoryTable",
    "PeakChange",
    "RunComparison",
    "add_cli_parsers",
    "compare_runs",
    "read_junit",
    "read_memory_table",
]

PREFIX = "vram_"
ENV_PREFIX = "vram_env_"
_INT_RE = re.compile(r"^-?\d+$")
_NO_PROPERTIES_HINT = (
    "run pytest with --junitxml and --vram-report (or a vram marker or fixture), "
    "and without --vram-junit-properties=no"
)


class JUnitFileError(ValueError):
    """A file that cannot be read as a JUnit XML report."""


@dataclass
class MemoryTable:
    """The measured tests of one JUnit file."""

    path: str
    #: One dict per measured test: ``name``, ``outcome`` and its ``vram_*`` properties.
    rows: list[dict[str, Any]]
    #: Each distinct environment the suites name in ``vram_env_*`` properties, keyed
    #: ``backend``, ``device``, ``torch``, ``cuda``, ``driver`` and ``total_memory``.
    environments: list[dict[str, Any]]
    #: Test cases in the file, measured or not.
    total: int


def read_memory_table(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The measured tests of a JUnit XML file, one dict each.

    A row holds ``name`` (``classname::name`` as the JUnit file spells it), ``outcome``
    (``passed``, ``failed``, ``error`` or ``skipped``) and the test's ``vram_*`` properties, with
    integer values as ints. Tests without vram properties are left out. Raises
    :class:`JUnitFileError` for a file that is missing, empty or not JUnit XML.
    """
    return read_junit(path).rows


def read_junit(path: str | os.PathLike[str]) -> MemoryTable:
    """Like :func:`read_memory_table`, with the environments and the count of all tests."""
    xml = _parse(path)
    rows: list[dict[str, Any]] = []
    environments: list[dict[str, Any]] = []
    total = 0
    try:
        for suite in xml:
            for env in _environments(suite, path).values():
                if env not in environments:
                    environments.append(env)
            # Iterating a suite also yields the cases of suites nested in it.
            for case in suite:
                total += 1
                row = _row(case, path)
                if row is not None:
                    rows.append(row)
    except RecursionError:
        raise JUnitFileError(f"{path}: test suites are nested too deeply") from None
    return MemoryTable(path=os.fspath(path), rows=rows, environments=environments, total=total)


_ENV_KEYS = ("backend", "device", "torch", "cuda", "driver", "total_memory")


def _environments(suite: Any, path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """A suite's ``vram_env_*`` properties, per environment.

    One environment is spelt ``vram_env_device``; several ``vram_env_<name>_device``.
    """
    environments: dict[str, dict[str, Any]] = {}
    for prop in suite.properties():
        if not prop.name or not prop.name.startswith(ENV_PREFIX) or prop.value is None:
            continue
        rest = prop.name[len(ENV_PREFIX) :]
        for key in _ENV_KEYS:
            if rest == key or rest.endswith("_" + key):
                name = rest[: -len(key)].rstrip("_")
                if key == "total_memory":
                    where = f"suite {suite.name}" if suite.name else "a test suite"
                    value: int | str = _figure(prop.name, prop.value, path, where)
                else:
                    value = _value(prop.value)
                environments.setdefault(name, {})[key] = value
                break
    return environments


def _parse(path: str | os.PathLike[str]) -> JUnitXml:
    name = os.fspath(path)
    try:
        with open(path, "rb") as stream:
            data = stream.read()
    except FileNotFoundError:
        raise JUnitFileError(f"{name}: no such file") from None
    except IsADirectoryError:
        raise JUnitFileError(f"{name}: is a directory, not a JUnit XML file") from None
    except OSError as exc:
        raise JUnitFileError(f"{name}: cannot read it: {exc.strerror or exc}") from None
    expected = "expected a JUnit XML report such as pytest --junitxml writes"
    if not data.strip():
        raise JUnitFileError(f"{name}: the file is empty; {expected}")
    try:
        return JUnitXml.fromstring(data)
    except JUnitXmlError:
        root = _root_tag(data)
        raise JUnitFileError(
            f"{name}: the root element is <{root}>, not <testsuites> or <testsuite>; {expected}"
        ) from None
    # ElementTree's and lxml's parse errors are both SyntaxErrors; a declared encoding Python
    # does not know raises LookupError, one it cannot decode ValueError.
    except (SyntaxError, ValueError, LookupError) as exc:
        raise JUnitFileError(f"{name}: cannot parse it as XML ({exc}); {expected}") from None


def _root_tag(data: bytes) -> str:
    try:
        return str(ElementTree.fromstring(data).tag)
    except Exception:  # the tag only decorates the message
        return "?"


def _row(case: Any, path: str | os.PathLike[str]) -> dict[str, Any] | None:
    properties = case.child(Properties)
    if properties is None:
        return None
    classname, name = case.classname or "", case.name or ""
    test = f"{classname}::{name}" if classname else name
    values: dict[str, Any] = {}
    for prop in properties:
        if not prop.name or not prop.name.startswith(PREFIX) or prop.value is None:
            continue
        if _holds_bytes(prop.name):
            values[prop.name] = _figure(prop.name, prop.value, path, f"test {test}")
        else:
            values[prop.name] = _value(prop.value)
    if not values:
        return None
    if case.is_error:
        outcome = "error"
    elif case.is_failure:
        outcome = "failed"
    elif case.is_skipped:
        outcome = "skipped"
    else:
        outcome = "passed"
    return {"name": test, "outcome": outcome, **values}


# The vram_* properties in bytes besides the figures a baseline stores (report/junit.py
# writes them), and those of them that are differences, negative when memory fell.
_BYTE_PROPERTIES = frozenset({"baseline", "start_allocated", "leftover", "peak_increment"})
_SIGNED_PROPERTIES = frozenset({"peak_increment", "leak_growth"})


def _holds_bytes(name: str) -> bool:
    rest = name[len(PREFIX) :]
    return rest in _BYTE_PROPERTIES or is_known_figure(rest)


def _figure(name: str, text: str, path: str | os.PathLike[str], where: str) -> int:
    """A property in bytes; a value that is not one fails the whole read, as a figure left
    out would silently pass a comparison."""
    try:
        return figure_from_text(name, text, signed=name[len(PREFIX) :] in _SIGNED_PROPERTIES)
    except FigureError as exc:
        raise JUnitFileError(f"{os.fspath(path)}: {where}: property {exc}") from None


def _value(text: str) -> int | str:
    text = text.strip()
    if _INT_RE.match(text):
        try:
            return int(text)
        except ValueError:  # more digits than Python converts: the text, as any other
            pass
    return text


# --- compare ----------------------------------------------------------------------------------


@dataclass
class PeakChange:
    """One test's peak allocated in the base run and in the head run."""

    name: str
    #: grown (beyond the tolerance), within-tolerance, shrunk, unchanged, new or removed.
    kind: str
    base: int | None
    head: int | None

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
        changes.append(PeakChange(name=name, kind=kind, base=before, head=after))
    changes.sort(key=lambda c: (_KIND_ORDER.index(c.kind), -abs(c.delta or 0), c.name))
    return RunComparison(tolerance=tolerance, changes=changes)


def _peaks(rows: list[dict[str, Any]]) -> dict[str, int]:
    peaks: dict[str, int] = {}
    for row in rows:
        peak = row.get("vram_peak_allocated")
        if isinstance(peak, int) and not isinstance(peak, bool):
            name = str(row.get("name"))
            peaks[name] = max(peak, peaks.get(name, peak))
    return peaks


# --- the commands -----------------------------------------------------------------------------


def add_cli_parsers(subcommands: Any) -> None:
    """Add ``summary`` and ``compare`` to the ``pytest-vram`` command."""
    summary = subcommands.add_parser(
        "summary",
        help="print the memory table of a JUnit XML file",
        description="Print the memory figures pytest-vram recorded in a JUnit XML file.",
    )
    summary.add_argument(
        "file", metavar="FILE", help="a JUnit XML file written by pytest --junitxml"
    )
    summary.set_defaults(run=_run_summary)

    comparison = subcommands.add_parser(
        "compare",
        help="compare the memory of two JUnit XML files",
        description=(
            "Compare each test's peak allocated memory between two JUnit XML files. "
            "Exit status 1 when a test grew beyond the tolerance, else 0."
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
    comparison.set_defaults(run=_run_compare)


def _tolerance(text: str) -> Tolerance:
    try:
        return parse_tolerance(text)
    except SizeError as exc:
        raise UsageError(f"--tolerance: {exc}") from None


def _run_summary(args: argparse.Namespace) -> int:
    table = read_junit(args.file)
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
    # Imported here: the JSON reader builds its tables with this module.
    from pytest_vram.jsonfiles import read_reports

    base, head = read_reports(args.base, args.head)
    if not head.rows:
        raise JUnitFileError(
            f"{head.path}: none of its {plural(head.total, 'test')} carries vram "
            f"properties, so there is nothing to compare; {_NO_PROPERTIES_HINT}"
        )
    result = compare_runs(base.rows, head.rows, args.tolerance)
    if args.markdown:
        print(render_comparison(result, base.rows, head.rows), end="")
    else:
        print(_compare_text(base, head, result), end="")
    return 1 if result.failed else 0


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
