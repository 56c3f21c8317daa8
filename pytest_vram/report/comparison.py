"""The pull-request comment: ``pytest-vram compare --markdown``.

Rendered from a comparison of two runs (see
:func:`pytest_vram.report.runcomparison.compare_runs`) and the rows of both: the tests whose
peak changed, biggest change first, then the budgets the head run crosses, the new tests and
the removed ones. A workflow posts the text as one comment and edits it on each push; it
finds its own comment by :data:`MARKER`. When nothing changed the text is empty, so the
workflow can delete a comment that would otherwise show stale figures.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from pytest_vram.record.figures import category_label
from pytest_vram.record.status import Status, rank_of
from pytest_vram.report.markdown import _code, _html_code, _text
from pytest_vram.report.peakchange import LineChange, PeakExplanation, explain, largest_rows
from pytest_vram.report.text import as_int, change_text, plural, size_text
from pytest_vram.units import format_delta

__all__ = ["MARKER", "MAX_COMMENT_CHARS", "render_comparison"]

#: The first line of every comment, so a workflow finds the comment it posted before.
MARKER = "<!-- pytest-vram -->"
#: GitHub refuses a comment over 65,536 characters; the rest is room for a workflow's own text.
MAX_COMMENT_CHARS = 60_000

_MISSING = "—"
_CHANGED = ("grown", "within-tolerance", "shrunk")
_OVER_BUDGET = Status.OVER_BUDGET.value


class _Change(Protocol):
    name: str
    kind: str
    base: int | None
    head: int | None
    beyond: bool

    @property
    def delta(self) -> int | None: ...

    @property
    def percent(self) -> float | None: ...


class _Comparison(Protocol):
    tolerance: object
    changes: Sequence[_Change]

    @property
    def failed(self) -> bool: ...

    def of_kind(self, kind: str) -> list[_Change]: ...

    def counts(self) -> list[tuple[str, int, str]]: ...


def render_comparison(
    result: _Comparison,
    base_rows: Iterable[Mapping[str, Any]],
    head_rows: Iterable[Mapping[str, Any]],
    *,
    limit: int = 50,
    max_chars: int = MAX_COMMENT_CHARS,
) -> str:
    """The comment's Markdown, or ``""`` when no test's peak changed and no budget was crossed.

    ``base_rows`` and ``head_rows`` are the two runs' memory tables (rows as
    :func:`pytest_vram.report.junitfile.read_memory_table` returns them): they give each test's
    status, for the budgets crossed, and the devices measured on. Each table lists at most ``limit``
    tests; the text never exceeds ``max_chars``.
    """
    base_rows, head_rows = list(base_rows), list(head_rows)
    changed = sorted(
        (c for c in result.changes if c.kind in _CHANGED),
        key=lambda c: (-abs(c.delta or 0), c.name),
    )
    new = sorted(result.of_kind("new"), key=lambda c: (-(c.head or 0), c.name))
    removed = sorted(result.of_kind("removed"), key=lambda c: (-(c.base or 0), c.name))
    crossed = _budgets_crossed(base_rows, head_rows)
    if not (changed or new or removed or crossed):
        return ""

    parts = [MARKER, "### GPU memory against the base (pytest-vram)", ""]
    parts.append(_counts_line(result, len(crossed)))
    tolerance = _text(str(result.tolerance))
    if result.failed:
        grown = plural(len(result.of_kind("grown")), "test")
        parts += ["", f"**{grown} grew beyond the tolerance ({tolerance}).**"]
    note = _devices_note(base_rows, head_rows)
    if note:
        parts += ["", note]
    text = "\n".join(parts) + "\n"

    text += _table(
        "",
        ["Test", "Base", "Head", "Change", "Result"],
        "|---|---:|---:|---:|---|",
        [_changed_cells(c, tolerance) for c in _shown_first(changed, limit)],
        len(changed),
    )
    base_peaks = {c.name: c.base for c in result.changes}
    text += _table(
        "Budgets crossed",
        ["Test", "Base", "Head", "Budget"],
        "|---|---:|---:|---:|",
        [
            [
                _code(str(row["name"])),
                size_text(base_peaks.get(str(row["name"])), _MISSING),
                size_text(row.get("vram_peak_allocated"), _MISSING),
                size_text(row.get("vram_budget"), _MISSING),
            ]
            for row in crossed[:limit]
        ],
        len(crossed),
    )
    statuses = _statuses(head_rows)
    text += _table(
        "New tests",
        ["Test", "Head", "Status"],
        "|---|---:|---|",
        [
            [_code(c.name), size_text(c.head, _MISSING), _text(statuses.get(c.name, ""))]
            for c in new[:limit]
        ],
        len(new),
    )
    text += _table(
        "Removed tests",
        ["Test", "Base"],
        "|---|---:|",
        [[_code(c.name), size_text(c.base, _MISSING)] for c in removed[:limit]],
        len(removed),
    )
    if len(text) > max_chars:  # the tables alone are cut: no room for more
        return _fit(text, max_chars)
    return text + _explanations(result, base_rows, head_rows, limit, max_chars - len(text))


def _explanations(
    result: _Comparison,
    base_rows: list[Mapping[str, Any]],
    head_rows: list[Mapping[str, Any]],
    limit: int,
    room: int,
) -> str:
    """A collapsed section per test whose peak moved beyond the tolerance: what changed at
    its peak. Sections that would pass ``room`` are left out whole, never cut."""
    changes = sorted(
        (c for c in result.changes if c.beyond), key=lambda c: (-abs(c.delta or 0), c.name)
    )[:limit]
    if not changes:
        return ""
    base, head = largest_rows(base_rows), largest_rows(head_rows)
    heading = "\n#### What changed at the peak\n"
    blocks, silent = [], 0
    for change in changes:
        explanation = explain(base.get(change.name), head.get(change.name))
        if explanation.empty:
            silent += 1
            continue
        blocks.append(_details(change, explanation))
    note = ""
    if silent:
        note = (
            f"\n_{plural(silent, 'test')} without what was alive at the peak in both reports "
            "(category totals are taken on sim and cpu, and on cuda under --vram-breakdown)._\n"
        )
    text = heading
    for block in blocks:
        if len(text) + len(block) + len(note) + len(_LEFT_OUT) > room:
            text += _LEFT_OUT
            break
        text += block
    if text == heading and not note:
        return ""
    return text + note if len(text) + len(note) <= room else ""


_LEFT_OUT = "\n_More tests changed at the peak; the comment has no room for them._\n"


def _details(change: _Change, explanation: PeakExplanation) -> str:
    """One test's ``<details>``: its categories, the modules and the lines that grew."""
    summary = f"{_html_code(change.name)}: {change_text(change.delta, change.percent, _MISSING)}"
    parts = [f"\n<details><summary>{summary}</summary>"]
    if explanation.categories is not None:
        changed = [
            f"{_text(category_label(name))} {format_delta(delta)}"
            for name, delta in explanation.categories
        ]
        if explanation.unchanged:
            unchanged = ", ".join(_text(category_label(name)) for name in explanation.unchanged)
            changed.append(f"{unchanged} unchanged")
        parts.append(
            "At the peak, against the base: " + ("; ".join(changed) or "no category changed")
        )
    elif explanation.head_categories:
        held = sorted(explanation.head_categories.items(), key=lambda item: -item[1])
        parts.append(
            "At the peak (the base report has no categories): "
            + ", ".join(f"{_text(category_label(name))} {size_text(size)}" for name, size in held)
        )
    if explanation.modules:
        parts.append(
            "Modules that grew: "
            + ", ".join(
                f"{_code(name)} {format_delta(delta)}" for name, delta in explanation.modules
            )
        )
    if explanation.lines:
        parts.append("Lines that grew:\n\n" + _line_items(explanation.lines, grown=True))
    elif explanation.head_lines:
        parts.append(
            "Lines alive at the peak (the base report has none for this test):\n\n"
            + _line_items(explanation.head_lines, grown=False)
        )
    return "\n\n".join(parts) + "\n\n</details>\n"


def _line_items(lines: Sequence[LineChange], *, grown: bool) -> str:
    items = []
    for line in lines:
        text = f" {_code(line.text)}" if line.text else ""
        size = format_delta(line.delta) if grown else size_text(line.head)
        items.append(
            f"- {_code(line.location)}{text}: {size} ({_text(category_label(line.category))})"
        )
    return "\n".join(items)


def _shown_first(changed: list[_Change], limit: int) -> list[_Change]:
    """At most ``limit`` changes, biggest first; the ones that fail the comparison are kept
    before any other when some must be left out."""
    if len(changed) <= limit:
        return changed
    kept = [c for c in changed if c.kind == "grown"][:limit]
    kept += [c for c in changed if c.kind != "grown"][: limit - len(kept)]
    return sorted(kept, key=changed.index)


def _changed_cells(change: _Change, tolerance: str) -> list[str]:
    result = {
        "grown": f"**grown beyond {tolerance}**",
        "within-tolerance": "grown within the tolerance",
        "shrunk": "shrunk",
    }[change.kind]
    return [
        _code(change.name),
        size_text(change.base, _MISSING),
        size_text(change.head, _MISSING),
        change_text(change.delta, change.percent, _MISSING),
        result,
    ]


def _table(heading: str, header: list[str], rule: str, rows: list[list[str]], total: int) -> str:
    if not rows:
        return ""
    text = f"\n#### {heading}\n\n" if heading else "\n"
    text += "| " + " | ".join(header) + " |\n" + rule + "\n"
    text += "".join("| " + " | ".join(cells) + " |\n" for cells in rows)
    if total > len(rows):
        text += f"\n_{plural(total - len(rows), 'more test')} not shown._\n"
    return text


def _counts_line(result: _Comparison, crossed: int) -> str:
    counts = [
        f"{count} {_text(words)}" for kind, count, words in result.counts() if kind != "unchanged"
    ]
    if crossed:
        counts.append(f"{crossed} over {'its budget' if crossed == 1 else 'their budgets'}")
    unchanged = len(result.of_kind("unchanged"))
    line = ", ".join(counts) if counts else "no peak changed"
    if unchanged:
        line += f"; {unchanged} unchanged"
    return line + "."


def _budgets_crossed(
    base_rows: list[Mapping[str, Any]], head_rows: list[Mapping[str, Any]]
) -> list[Mapping[str, Any]]:
    """The head rows over a budget whose test was within its budgets (or absent) in the base,
    largest head peak first."""
    base = _statuses(base_rows)
    crossed: dict[str, Mapping[str, Any]] = {}
    for row in head_rows:
        name = str(row.get("name"))
        if row.get("vram_status") == _OVER_BUDGET and base.get(name) != _OVER_BUDGET:
            crossed.setdefault(name, row)
    return sorted(
        crossed.values(),
        key=lambda r: (-(as_int(r.get("vram_peak_allocated")) or 0), str(r.get("name"))),
    )


def _statuses(rows: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """Each test's status; a test listed twice (several backends) keeps its worst."""
    statuses: dict[str, str] = {}
    for row in rows:
        name, status = str(row.get("name")), str(row.get("vram_status") or "")
        if name not in statuses or rank_of(status) < rank_of(statuses[name]):
            statuses[name] = status
    return statuses


def _devices_note(base_rows: list[Mapping[str, Any]], head_rows: list[Mapping[str, Any]]) -> str:
    if not base_rows:
        return "_The base report has no measured test: every test counts as new._"
    base, head = _devices(base_rows), _devices(head_rows)
    if base == head:
        return ""
    # A peak on one GPU model and a peak on another are not the same measurement.
    return (
        f"_Measured on different devices: base {_text(', '.join(base) or '?')}, "
        f"head {_text(', '.join(head) or '?')}._"
    )


def _devices(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    return sorted({str(r["vram_device"]) for r in rows if "vram_device" in r})


def _fit(text: str, max_chars: int) -> str:
    """``text`` cut at a line end to at most ``max_chars``, saying so."""
    if len(text) <= max_chars:
        return text
    note = "\n_The comment is cut here: it would pass GitHub's size limit._\n"
    cut = text.rfind("\n", 0, max_chars - len(note)) + 1
    return text[:cut] + note
