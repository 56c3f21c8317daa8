"""What changed at a test's peak between two runs: categories, modules and source lines.

``pytest-vram compare`` explains each test whose peak moved beyond the tolerance from what both
reports carry about that peak: the category totals (``vram_categories``, on sim and cpu and
under ``--vram-breakdown``), the modules (``vram_modules``, under ``--vram-breakdown``) and the
lines of the user's code that allocated the memory alive at the peak (``vram_peak_lines``,
recorded for a test that failed or regressed). The rows are those of
:mod:`pytest_vram.report.jsonfile`; a JUnit file carries the lines only. Everything here is
plain data: the renderers neutralise the names before they show them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_vram.record.figures import CATEGORIES, category_label
from pytest_vram.report.text import as_int, size_text
from pytest_vram.units import format_delta

__all__ = [
    "LineChange",
    "PeakExplanation",
    "add_lines",
    "explain",
    "explanation_lines",
    "flagged_tests",
    "largest_rows",
    "read_peak_line",
]

#: How many modules and lines an explanation lists, largest first.
SHOWN = 5


@dataclass(frozen=True)
class LineChange:
    """One line of the user's code whose bytes alive at the peak changed."""

    #: ``model.py:54`` as the head run names it (the base's where the head lost the line).
    location: str
    #: The line's source text, stripped; empty when the file could not be read.
    text: str
    category: str
    delta: int
    #: Bytes alive at the peak from this line in the head run.
    head: int


@dataclass
class PeakExplanation:
    """The changes at one test's peak. A list is empty where a report does not carry it."""

    #: ``(category, bytes)`` that changed, growth first, largest first; None when a side has
    #: no category totals.
    categories: list[tuple[str, int]] | None = None
    #: Categories that held memory and did not change.
    unchanged: list[str] = field(default_factory=list)
    #: The head's totals, where only the head carries them.
    head_categories: dict[str, int] | None = None
    #: ``(module, bytes)`` that grew, largest first, where both sides carry modules.
    modules: list[tuple[str, int]] = field(default_factory=list)
    #: Lines that grew, largest first, where both sides carry lines.
    lines: list[LineChange] = field(default_factory=list)
    #: Lines the head carries where the base has none to compare with.
    head_lines: list[LineChange] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (
            self.categories
            or self.unchanged
            or self.head_categories
            or self.modules
            or self.lines
            or self.head_lines
        )


def largest_rows(rows: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Each test's row with the largest peak, as the comparison counts it (a test measured on
    several backends is compared by its largest peak)."""
    found: dict[str, Mapping[str, Any]] = {}
    for row in rows:
        name = str(row.get("name"))
        peak = as_int(row.get("vram_peak_allocated"))
        if peak is None:
            continue
        if name not in found or peak > (as_int(found[name].get("vram_peak_allocated")) or 0):
            found[name] = row
    return found


def add_lines(rows: list[dict[str, Any]], extra: Iterable[Mapping[str, Any]]) -> None:
    """Give ``rows`` the peak lines that the rows of another run of the same tests carry (a
    second pass over the flagged tests), where they have none."""
    lines = {
        str(row.get("name")): row["vram_peak_lines"] for row in extra if "vram_peak_lines" in row
    }
    for row in rows:
        found = lines.get(str(row.get("name")))
        if found is not None and "vram_peak_lines" not in row:
            row["vram_peak_lines"] = found


_FLAGGING = frozenset({"oom", "over-budget", "leak", "regression"})
# A node id pytest can be given as it is: a relative path, then ::names; no option, no
# argument file, no way out of the checkout.
_PLAIN_NODEID = re.compile(r"^(?![-@/\\])(?!.*(?:^|/)\.\.(?:/|::))[^\s\x00-\x1f]+::[^\x00-\x1f]+$")


def flagged_tests(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """The node ids of the gated tests a run flagged (a failing memory status, or lines
    taken at their peak), in order, each once; a node id that is not plain is left out."""
    found: dict[str, None] = {}
    for row in rows:
        if row.get("vram_status") == "ungated":
            continue
        if row.get("vram_status") in _FLAGGING or isinstance(row.get("vram_peak_lines"), list):
            name = str(row.get("name"))
            if _PLAIN_NODEID.match(name):
                found[name] = None
    return list(found)


def explain(
    base: Mapping[str, Any] | None, head: Mapping[str, Any] | None, shown: int = SHOWN
) -> PeakExplanation:
    """What changed at the peak from ``base``'s row to ``head``'s."""
    result = PeakExplanation()
    if head is None:
        return result
    base = base or {}
    before, after = (
        _categories(base.get("vram_categories")),
        _categories(head.get("vram_categories")),
    )
    if before is not None and after is not None:
        changed = [(name, after[name] - before[name]) for name in CATEGORIES]
        result.categories = sorted(
            ((name, delta) for name, delta in changed if delta), key=lambda item: -item[1]
        )
        result.unchanged = [
            name for name, delta in changed if not delta and (after[name] or before[name])
        ]
    elif after is not None:
        result.head_categories = {name: size for name, size in after.items() if size}
    modules_before, modules_after = (
        _modules(base.get("vram_modules")),
        _modules(head.get("vram_modules")),
    )
    if modules_before is not None and modules_after is not None:
        grown = [
            (name, size - modules_before.get(name, 0))
            for name, size in modules_after.items()
            if size > modules_before.get(name, 0)
        ]
        result.modules = sorted(grown, key=lambda item: (-item[1], item[0]))[:shown]
    lines_before, lines_after = _lines(_row_lines(base)), _lines(_row_lines(head))
    if lines_after is not None and lines_before is not None:
        result.lines = _grown_lines(lines_before, lines_after)[:shown]
    elif lines_after:
        result.head_lines = sorted(
            (
                LineChange(location, text, category, size, size)
                for (_, text, category), (location, size) in lines_after.items()
            ),
            key=lambda line: (-line.delta, line.location),
        )[:shown]
    return result


class _Named(Protocol):
    name: str

    @property
    def delta(self) -> int | None: ...


def explanation_lines(
    changes: Iterable[_Named],
    base_rows: Iterable[Mapping[str, Any]],
    head_rows: Iterable[Mapping[str, Any]],
) -> list[str]:
    """The terminal's account of each change: ``at the peak of NAME:`` and what changed,
    biggest change first; a blank line after each test."""
    base, head = largest_rows(base_rows), largest_rows(head_rows)
    lines = []
    for change in sorted(changes, key=lambda c: (-abs(c.delta or 0), c.name)):
        explanation = explain(base.get(change.name), head.get(change.name))
        if explanation.empty:
            continue
        lines.append(f"at the peak of {change.name}:")
        lines += ["  " + line for line in describe(explanation)]
        lines.append("")
    return lines


def describe(explanation: PeakExplanation) -> list[str]:
    """The explanation as plain lines (the terminal's; the comment escapes its own)."""
    lines = []
    if explanation.categories is not None:
        parts = [
            f"{category_label(name)} {format_delta(delta)}"
            for name, delta in explanation.categories
        ]
        if explanation.unchanged:
            parts.append(", ".join(map(category_label, explanation.unchanged)) + " unchanged")
        lines.append("categories: " + ("; ".join(parts) or "no category changed"))
    elif explanation.head_categories:
        held = sorted(explanation.head_categories.items(), key=lambda item: -item[1])
        lines.append(
            "categories (none in the base): "
            + ", ".join(f"{category_label(name)} {size_text(size)}" for name, size in held)
        )
    if explanation.modules:
        lines.append(
            "modules that grew: "
            + ", ".join(f"{name} {format_delta(delta)}" for name, delta in explanation.modules)
        )
    for line in explanation.lines:
        lines.append(
            f"line grew: {_line_text(line)}: {format_delta(line.delta)}"
            f" ({category_label(line.category)})"
        )
    for line in explanation.head_lines:
        lines.append(
            f"line at the peak (none in the base): {_line_text(line)}: "
            f"{size_text(line.head)} ({category_label(line.category)})"
        )
    return lines


def _line_text(line: LineChange) -> str:
    return f"{line.location} {line.text}" if line.text else line.location


# A line is matched by its file, its text and the category of its bytes, not its number: a
# change above it in the same file moves the number and leaves the line what it was.
_LineKey = tuple[str, str, str]


def _grown_lines(
    before: dict[_LineKey, tuple[str, int]], after: dict[_LineKey, tuple[str, int]]
) -> list[LineChange]:
    grown = []
    for key, (location, size) in after.items():
        then = before.get(key, ("", 0))[1]
        if size > then:
            grown.append(LineChange(location, key[1], key[2], size - then, size))
    return sorted(grown, key=lambda line: (-line.delta, line.location))


_JUNIT_LINE = re.compile(r"^(\d+) (\S+) (.+?):(\d+)(?: (.*))?$")


def read_peak_line(text: str) -> dict[str, Any] | None:
    """A JUnit ``vram_peak_line_N`` value (``BYTES CATEGORY FILE:LINE TEXT``) as the JSON
    report's entry; None for text of another shape."""
    match = _JUNIT_LINE.match(str(text))
    if match is None:
        return None
    size, category, filename, line, source = match.groups()
    return {
        "file": filename,
        "line": int(line),
        "text": source or "",
        "bytes": int(size),
        "category": category,
    }


def _row_lines(row: Mapping[str, Any]) -> object:
    """A row's peak lines: a JSON report's list, or a JUnit file's numbered properties."""
    if "vram_peak_lines" in row:
        return row["vram_peak_lines"]
    numbered = []
    index = 1
    while f"vram_peak_line_{index}" in row:
        entry = read_peak_line(row[f"vram_peak_line_{index}"])
        if entry is not None:
            numbered.append(entry)
        index += 1
    return numbered if index > 1 else None


def _categories(value: object) -> dict[str, int] | None:
    if not isinstance(value, Mapping):
        return None
    return {name: max(0, as_int(value.get(name)) or 0) for name in CATEGORIES}


def _modules(value: object) -> dict[str, int] | None:
    if not isinstance(value, Mapping):
        return None
    modules = {}
    for name, size in value.items():
        nbytes = as_int(size)
        if nbytes is not None:
            modules[str(name)] = nbytes
    return modules


def _lines(value: object) -> dict[_LineKey, tuple[str, int]] | None:
    """Bytes by line key, with the line's ``file:line``; None when the row carries no lines."""
    if not isinstance(value, list):
        return None
    lines: dict[_LineKey, tuple[str, int]] = {}
    for entry in value:
        if not isinstance(entry, Mapping):
            continue
        nbytes = as_int(entry.get("bytes"))
        if nbytes is None:
            continue
        filename, line = str(entry.get("file") or "?"), as_int(entry.get("line"))
        text = " ".join(str(entry.get("text") or "").split())
        category = str(entry.get("category") or "other")
        # Without its text a line is known only by its number.
        key = (filename, text or f"#{line}", category)
        location = f"{filename}:{line}" if line is not None else filename
        old = lines.get(key, (location, 0))
        lines[key] = (old[0], old[1] + nbytes)
    return lines
