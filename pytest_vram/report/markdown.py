"""The Markdown report: a table for a CI job summary such as GitHub's ``$GITHUB_STEP_SUMMARY``.

Rendered from the report document (see :mod:`pytest_vram.report.document`): failures first,
then the largest peaks, so the lines a reviewer needs are at the top even when the table is cut
short.
"""

from __future__ import annotations

import html
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any

from pytest_vram.record.status import FAILING_STATUSES, rank_of
from pytest_vram.report.document import (
    baseline_peak,
    document_tests,
    snapshot_of,
    status_counts,
)
from pytest_vram.report.text import (
    as_int,
    change_text,
    counts_text,
    environment_line,
    plural,
    plural_noun,
    size_text,
)
from pytest_vram.units import format_size

__all__ = ["MAX_BYTES", "STEP_SUMMARY_LIMIT", "append_step_summary", "render_markdown"]

#: GitHub rejects a job summary over 1 MiB; half of it leaves room for other steps' output.
MAX_BYTES = 512 * 1024
STEP_SUMMARY_LIMIT = 1024 * 1024

_HEADER = "| Test | Backend | Peak | Baseline | Change | Status |\n|---|---|---:|---:|---:|---|\n"
_MISSING = "—"
# A message shown under the table is cut here: the JSON and HTML reports hold the full text.
_MESSAGE_CHARS = 2000


def render_markdown(
    document: Mapping[str, Any], limit: int = 50, *, max_bytes: int = MAX_BYTES
) -> str:
    """The job-summary Markdown for a report document.

    Every failing test is listed (worst status first), then the other tests by peak, largest
    first, until ``limit`` rows; a closing line says how many were left out. The result never
    exceeds ``max_bytes`` of UTF-8.
    """
    tests = document_tests(document)
    failing = sorted(
        (t for t in tests if t.get("status") in FAILING_STATUSES),
        key=lambda t: (rank_of(t["status"]), -_peak(t)),
    )
    others = sorted(
        (t for t in tests if t.get("status") not in FAILING_STATUSES), key=lambda t: -_peak(t)
    )
    rows = failing + others[: max(0, limit - len(failing))]

    head = "## GPU memory (pytest-vram)\n\n" + _totals_line(document) + "\n"
    environments = _environment_lines(document.get("environments") or {})
    if environments:
        head += "\n" + environments
    if not tests:
        return _fit(head + "\nNo test was measured.\n", max_bytes)
    head += "\n" + _HEADER

    # Reserve room for the closing line, so a cut table still says what it left out.
    budget = max_bytes - len(head.encode()) - 400
    body: list[str] = []
    used = 0
    for test in rows:
        line = _row(test)
        size = len(line.encode())
        if used + size > budget:
            break
        body.append(line)
        used += size
    shown = len(body)
    text = head + "".join(body)
    ranks = _ranks_table(rows[:shown])
    if len(text.encode()) + len(ranks.encode()) <= budget + len(head.encode()):
        text += ranks

    left_out = len(tests) - shown
    if left_out:
        failing_left = max(0, len(failing) - shown)
        note = plural(left_out, "more test") + " not shown"
        if failing_left:
            note += f", {failing_left} of them failing"
        if shown < len(rows):
            note += f" (the summary is capped at {format_size(max_bytes)})"
        text += f"\n_{note}; the JSON and HTML reports list every test._\n"

    details = _messages_block(failing[:shown], max_bytes - len(text.encode()))
    return _fit(text + details, max_bytes)


def append_step_summary(text: str, path: str | os.PathLike[str]) -> None:
    """Append ``text`` to a job-summary file such as ``$GITHUB_STEP_SUMMARY``; never overwrite.

    When the file would pass GitHub's 1 MiB limit, a one-line note is appended instead, so the
    summary other steps wrote stays readable.
    """
    try:
        existing = os.path.getsize(path)
    except OSError:
        existing = 0
    if not text.endswith("\n"):
        text += "\n"
    if existing + len(text.encode()) + 1 > STEP_SUMMARY_LIMIT:
        text = (
            "_pytest-vram: the memory table was left out: "
            "the job summary is near its 1 MiB limit._\n"
        )
    with open(path, "a", encoding="utf-8") as stream:
        # Start on a line of its own: the heading must not run into what an earlier step wrote.
        if existing:
            stream.write("\n")
        stream.write(text)


def _totals_line(document: Mapping[str, Any]) -> str:
    measured, counts = status_counts(document)
    line = f"**{measured}** {plural_noun(measured, 'test')} measured"
    if counts:
        line += ": " + counts_text(counts, label=_text)
    return line + "."


def _environment_lines(environments: Mapping[str, Any]) -> str:
    lines = []
    for name, env in environments.items():
        if isinstance(env, Mapping):
            backend = _text(str(env.get("backend") or name))
            lines.append(f"- {backend}: {_text(environment_line(env, device=str(name)))}\n")
    return "".join(lines)


def _row(test: Mapping[str, Any]) -> str:
    status = str(test.get("status") or "")
    shown_status = f"**{_text(status)}**" if status in FAILING_STATUSES else _text(status)
    cells = [
        _code(str(test.get("nodeid") or "")),
        _text(str(test.get("backend") or "")),
        size_text(_peak(test)),
        size_text(baseline_peak(test), _MISSING),
        change_text(test.get("change"), test.get("change_percent"), _MISSING),
        shown_status,
    ]
    return "| " + " | ".join(cells) + " |\n"


def _ranks_table(tests: Iterable[Mapping[str, Any]]) -> str:
    """Under torchrun: each rank's peak of the tests shown, the table's peak being the max."""
    tests = [test for test in tests if test.get("ranks")]
    if not tests:
        return ""
    count = max(len(test["ranks"]) for test in tests)
    text = (
        "\nPeak allocated per rank:\n\n| Test | "
        + " | ".join(f"Rank {rank}" for rank in range(count))
        + " | Max |\n|---|"
        + "---:|" * (count + 1)
        + "\n"
    )
    for test in tests:
        peaks = {entry["rank"]: entry["figures"].get("peak_allocated") for entry in test["ranks"]}
        cells = [_code(str(test.get("nodeid") or ""))]
        cells += [size_text(peaks.get(rank), _MISSING) for rank in range(count)]
        cells.append(size_text(_peak(test)))
        text += "| " + " | ".join(cells) + " |\n"
    return text


def _peak(test: Mapping[str, Any]) -> int:
    return as_int(test.get("peak_allocated")) or 0


def _messages_block(tests: Iterable[Mapping[str, Any]], room: int) -> str:
    lines = []
    for test in tests:
        for message in test.get("messages") or []:
            message = " ".join(str(message).split())
            if len(message) > _MESSAGE_CHARS:
                message = message[:_MESSAGE_CHARS] + "…"
            lines.append(f"{test.get('nodeid')}: {message}")
        snapshot = snapshot_of(test)
        if snapshot is not None:
            lines.append(f"{test.get('nodeid')}: memory snapshot: {' '.join(snapshot.split())}")
    if not lines:
        return ""
    body = "\n".join(lines)
    fence = "`" * max(3, _longest_backtick_run(body) + 1)
    block = (
        "\n<details><summary>Failure messages</summary>\n\n"
        f"{fence}text\n{body}\n{fence}\n\n</details>\n"
    )
    return block if len(block.encode()) <= room else ""


def _code(text: str) -> str:
    """``text`` as an inline code span that survives a table cell."""
    text = " ".join(text.split())
    ticks = "`" * (_longest_backtick_run(text) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    # GFM splits table cells on pipes before it parses code spans, even inside them.
    return f"{ticks}{pad}{text.replace('|', chr(92) + '|')}{pad}{ticks}"


def _html_code(text: str) -> str:
    """``text`` as an HTML ``<code>`` element, for where Markdown is not parsed (a
    ``<summary>``): escaped, so it shows as text; GitHub makes nothing live inside code."""
    text = " ".join(text.split())
    return "<code>" + html.escape(text, quote=True) + "</code>"


# Inside a line only these start markup; ``#``, ``-``, ``>`` and the like matter at line starts.
_MARKDOWN_SPECIAL = re.compile(r"([\\`*_\[\]|~])")


# What GitHub turns into a mention, a reference or a link in plain text, each kept from
# matching by a zero-width space: @user and @org/team, #1, GH-1, a commit's hex name (7 to 40
# hex digits), and the extended autolinks (www., scheme://; an e-mail address's @ is a mention's).
_ZWSP = "\u200b"
_GITHUB_LIVE = (
    (re.compile(r"@"), "@" + _ZWSP),
    (re.compile(r"#(?=\d)"), "#" + _ZWSP),
    (re.compile(r"\b(GH)-(?=\d)", re.I), r"\1-" + _ZWSP),
    (re.compile(r"\b(www)\.", re.I), r"\1" + _ZWSP + "."),
    (re.compile(r":(?=//)"), ":" + _ZWSP),
)
_HEX_RUN = re.compile(r"[0-9a-fA-F]{7,}")


def _text(text: str) -> str:
    """Plain text in a Markdown cell: no markup, no HTML, and nothing GitHub makes live (no
    mention, issue or commit reference, autolink). Text a report carries is shown through
    here or as a code span, so a crafted report cannot make a comment say more than text."""
    text = " ".join(text.split())
    text = _MARKDOWN_SPECIAL.sub(r"\\\1", text)
    text = text.replace("&", "&amp;").replace("<", "&lt;")
    for pattern, replacement in _GITHUB_LIVE:
        text = pattern.sub(replacement, text)
    # Six hex digits at most in a row: a commit's name needs seven.
    return _HEX_RUN.sub(lambda m: _ZWSP.join(re.findall(".{1,6}", m.group(0))), text)


def _longest_backtick_run(text: str) -> int:
    return max((len(run) for run in re.findall(r"`+", text)), default=0)


def _fit(text: str, max_bytes: int) -> str:
    data = text.encode()
    if len(data) <= max_bytes:
        return text
    return data[:max_bytes].decode(errors="ignore")
