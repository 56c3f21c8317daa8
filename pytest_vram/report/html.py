"""The HTML report: one self-contained page with charts, rendered from the report document.

Everything is inline (CSS and SVG, no scripts, fonts or links to fetch), so the file opens the
same from a CI artifact, an air-gapped machine or a mail attachment. Every string taken from the
document is escaped: node ids are user text and can hold ``<``, ``&`` and quotes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from html import escape
from typing import Any

from pytest_vram.record.figures import category_label
from pytest_vram.record.status import FAILING_STATUSES, Status
from pytest_vram.report.document import (
    baseline_peak,
    document_tests,
    snapshot_of,
    status_counts,
)
from pytest_vram.report.svg import line_chart, short_label, size_ticks, svg_start
from pytest_vram.report.text import ENVIRONMENT_FIELDS, as_int, change_text, size_text
from pytest_vram.units import format_delta, format_size

__all__ = ["MAX_BARS", "PAGE_CSS", "render_html"]

#: Bars in the peak chart; the document is worst first, so the cut keeps what matters.
MAX_BARS = 60

_STATUS_COLOURS = {
    Status.OOM.value: "#b4232a",
    Status.OVER_BUDGET.value: "#d1495b",
    Status.LEAK.value: "#c2410c",
    Status.REGRESSION.value: "#e4572e",
    Status.FAILED.value: "#9f1239",
    Status.NEW.value: "#2f6fdb",
    Status.IMPROVED.value: "#2e9d5b",
    Status.OK.value: "#7f9c8c",
    Status.SKIPPED.value: "#a3a3a3",
}
_OTHER_COLOUR = _STATUS_COLOURS[Status.OK.value]
# The environment table's headings, where they differ from the labels of a line.
_HEADINGS = {"driver": "Driver"}
_MISSING = "—"

_CSS = """
:root { color-scheme: light; --ink: #1f2328; --muted: #59636e; --line: #d0d7de; --panel: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; padding: 24px 32px 48px; font: 14px/1.45 -apple-system, "Segoe UI", Roboto,
  "Helvetica Neue", Arial, sans-serif; color: var(--ink); background: #fff; }
h1 { font-size: 24px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 8px; padding-bottom: 4px;
  border-bottom: 1px solid var(--line); }
h3 { font-size: 13px; margin: 0 0 4px; font-family: ui-monospace, SFMono-Regular, Menlo, Consolas,
  monospace; word-break: break-all; }
.meta, .note { color: var(--muted); margin: 0 0 8px; }
.cards { display: flex; flex-wrap: wrap; gap: 12px; margin: 16px 0; }
.card { border: 1px solid var(--line); border-radius: 8px; padding: 8px 16px; min-width: 110px;
  background: var(--panel); }
.card b { display: block; font-size: 22px; }
.card.bad b { color: #b4232a; }
.card span { color: var(--muted); }
table { border-collapse: collapse; width: 100%; }
th, td { text-align: left; padding: 4px 8px; border-bottom: 1px solid var(--line);
  vertical-align: top; }
th { background: var(--panel); font-weight: 600; }
td.num, th.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
td.test { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12px;
  word-break: break-all; }
td.msg { white-space: pre-wrap; font-size: 12px; color: var(--muted); max-width: 420px; }
tr.failing td.test { color: #9f1239; }
.badge { display: inline-block; padding: 0 8px; border-radius: 10px; color: #fff; font-size: 12px;
  white-space: nowrap; }
.legend { display: flex; flex-wrap: wrap; gap: 14px; color: var(--muted); font-size: 12px;
  margin: 4px 0; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
  vertical-align: -2px; border-radius: 2px; }
.legend i.marker { width: 3px; background: #1f2328; }
.charts { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 16px; }
figure { margin: 0; border: 1px solid var(--line); border-radius: 8px; padding: 12px; }
figcaption { color: var(--muted); font-size: 12px; margin-bottom: 4px; }
svg { display: block; max-width: 100%; height: auto; }
svg text { font: 11px -apple-system, "Segoe UI", Roboto, Arial, sans-serif; fill: #59636e; }
svg text.label { fill: #1f2328;
  font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
"""
#: The page style, for other pages of the same look (``pytest-vram fit --html``).
PAGE_CSS = _CSS


def render_html(document: Mapping[str, Any]) -> str:
    """The report page for a report document, as one self-contained HTML string."""
    tests = document_tests(document)
    parts = [
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        "<title>pytest-vram report</title>\n"
        f"<style>{_CSS}</style>\n</head>\n<body>\n",
        _header(document),
        _cards(document),
        _environments(document.get("environments") or {}),
        _peak_section(tests),
        _leak_section(tests),
        _breakdown_section(tests),
        _lines_section(tests),
        _table_section(tests),
        "</body>\n</html>\n",
    ]
    return "".join(parts)


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def _header(document: Mapping[str, Any]) -> str:
    meta = []
    if document.get("pytest_vram"):
        meta.append(f"pytest-vram {_e(document['pytest_vram'])}")
    if document.get("created"):
        meta.append(f"created {_e(document['created'])}")
    return "<h1>GPU memory report</h1>\n" + (
        f'<p class="meta">{" · ".join(meta)}</p>\n' if meta else ""
    )


def _cards(document: Mapping[str, Any]) -> str:
    measured, counts = status_counts(document)
    cards = [f'<div class="card"><b>{measured}</b><span>measured</span></div>']
    for status, count in counts.items():
        bad = " bad" if status in FAILING_STATUSES else ""
        cards.append(f'<div class="card{bad}"><b>{count}</b><span>{_e(status)}</span></div>')
    return '<div class="cards">' + "".join(cards) + "</div>\n"


def _environments(environments: Mapping[str, Any]) -> str:
    rows = []
    for name, env in environments.items():
        if not isinstance(env, Mapping):
            continue
        cells = [env.get("backend") or name, env.get("device") or ""]
        cells += [env.get(key) or "" for key, _ in ENVIRONMENT_FIELDS]
        rows.append(
            "<tr>"
            + "".join(f"<td>{_e(c)}</td>" for c in cells)
            + f'<td class="num">{_e(size_text(env.get("total_memory"), ""))}</td></tr>'
        )
    if not rows:
        return ""
    headings = "".join(f"<th>{_HEADINGS.get(key, label)}</th>" for key, label in ENVIRONMENT_FIELDS)
    return (
        f"<h2>Environments</h2>\n<table><thead><tr><th>Backend</th><th>Device</th>{headings}"
        '<th class="num">Total memory</th></tr></thead><tbody>'
        + "".join(rows)
        + "</tbody></table>\n"
    )


# --- peaks against baselines --------------------------------------------------------------------


def _peak_section(tests: list[Mapping[str, Any]]) -> str:
    shown = [t for t in tests if as_int(t.get("peak_allocated")) is not None][:MAX_BARS]
    if not shown:
        return '<h2>Peaks against baselines</h2>\n<p class="note">No test was measured.</p>\n'
    left, right, value_width = 330, 960, 130
    row, top = 22, 28
    width = right + value_width
    height = top + row * len(shown) + 8
    largest = 1
    for test in shown:
        largest = max(largest, test["peak_allocated"], baseline_peak(test) or 0)
    ticks, _ = size_ticks(0, largest)
    scale_max = ticks[-1][0]

    def x(value: float) -> float:
        return left + (right - left) * value / scale_max

    svg = [svg_start(width, height, "Peak allocated per test against its baseline")]
    for position, label in ticks:
        px = x(position)
        svg.append(
            f'<line x1="{px:.1f}" y1="{top - 4}" x2="{px:.1f}" y2="{height - 8}" stroke="#eaeef2"/>'
            f'<text x="{px:.1f}" y="{top - 10}" text-anchor="middle">{_e(label)}</text>'
        )
    for index, test in enumerate(shown):
        y = top + index * row
        peak = test["peak_allocated"]
        status = str(test.get("status") or "")
        colour = _STATUS_COLOURS.get(status, _OTHER_COLOUR)
        nodeid = str(test.get("nodeid") or "")
        baseline = baseline_peak(test)
        tip = f"{nodeid}\npeak {format_size(peak)}"
        if baseline is not None:
            tip += f"\nbaseline {format_size(baseline)}"
        tip += f"\n{status}"
        svg.append(
            f"<g><title>{_e(tip)}</title>"
            f'<text class="label" x="{left - 8}" y="{y + 15}" text-anchor="end">'
            f"{_e(short_label(nodeid, 46))}</text>"
            f'<rect x="{left}" y="{y + 4}" width="{max(1.0, x(peak) - left):.1f}" '
            f'height="{row - 8}" rx="2" fill="{colour}"/>'
        )
        if baseline is not None:
            bx = x(baseline)
            svg.append(
                f'<line x1="{bx:.1f}" y1="{y + 1}" x2="{bx:.1f}" y2="{y + row - 1}" '
                'stroke="#1f2328" stroke-width="2.5"/>'
            )
        svg.append(f'<text x="{right + 10}" y="{y + 15}">{_e(format_size(peak))}</text></g>')
    svg.append("</svg>")

    present = []
    for test in shown:
        status = str(test.get("status") or "")
        if status not in present:
            present.append(status)
    legend = "".join(
        f'<span><i style="background:{_STATUS_COLOURS.get(s, _OTHER_COLOUR)}"></i>{_e(s)}</span>'
        for s in present
    )
    legend += '<span><i class="marker"></i>baseline</span>'
    note = ""
    measured = sum(1 for t in tests if as_int(t.get("peak_allocated")) is not None)
    if measured > len(shown):
        note = (
            f'<p class="note">The {len(shown)} tests listed first of {measured}; '
            "the table below has them all.</p>\n"
        )
    return (
        "<h2>Peaks against baselines</h2>\n"
        f'<div class="legend">{legend}</div>\n{note}' + "".join(svg) + "\n"
    )


# --- leak checks --------------------------------------------------------------------------------


def _leak_section(tests: list[Mapping[str, Any]]) -> str:
    figures = []
    for test in tests:
        scenarios = test.get("scenarios")
        leak = scenarios.get("leak_check") if isinstance(scenarios, Mapping) else None
        if not isinstance(leak, Mapping):
            continue
        series = [v for v in leak.get("per_step") or [] if as_int(v) is not None]
        if not series:
            continue
        figures.append(_leak_figure(str(test.get("nodeid") or ""), leak, series))
    if not figures:
        return ""
    return (
        "<h2>Leak checks</h2>\n"
        '<p class="note">Allocated bytes after each step, after the warm-up steps.</p>\n'
        '<div class="charts">' + "".join(figures) + "</div>\n"
    )


def _leak_figure(nodeid: str, leak: Mapping[str, Any], series: Sequence[int]) -> str:
    leaked = bool(leak.get("leaked"))
    growth = as_int(leak.get("growth"))
    facts = []
    if growth is not None:
        facts.append(f"growth {format_delta(growth)}")
    per_step = leak.get("growth_per_step")
    if isinstance(per_step, (int, float)) and not isinstance(per_step, bool):
        facts.append(f"{format_delta(round(per_step))} per step")
    for key, label in (("steps", "steps"), ("warmup", "warm-up")):
        if as_int(leak.get(key)) is not None:
            facts.append(f"{leak[key]} {label}")
    if leak.get("tolerance") not in (None, ""):
        facts.append(f"tolerance {leak['tolerance']}")
    badge_colour = _STATUS_COLOURS["leak"] if leaked else _STATUS_COLOURS["ok"]
    badge_text = "leak" if leaked else "no leak"
    badge = f'<span class="badge" style="background:{badge_colour}">{badge_text}</span>'
    return (
        f"<figure><h3>{_e(nodeid)}</h3><figcaption>{badge} {_e(' · '.join(facts))}</figcaption>"
        + line_chart(series, "#c2410c" if leaked else "#2f6fdb")
        + _sites_table(leak.get("sites"))
        + "</figure>"
    )


def _sites_table(sites: Any) -> str:
    """Where a failed leak check's surviving memory was allocated."""
    if not isinstance(sites, Sequence) or not sites:
        return ""
    rows = []
    for site in sites[:_SITES_SHOWN]:
        if not isinstance(site, Mapping):
            continue
        rows.append(
            f'<tr><td class="test">{_e(site.get("location") or "")}</td>'
            f'<td class="num">{_e(size_text(site.get("bytes"), _MISSING))}</td>'
            f'<td class="num">{_e(as_int(site.get("count")) or 0)}</td></tr>'
        )
    return (
        '<table class="sites"><thead><tr><th>Allocated at</th><th class="num">Still alive</th>'
        '<th class="num">Allocations</th></tr></thead><tbody>' + "".join(rows) + "</tbody></table>"
    )


# --- peak breakdowns ----------------------------------------------------------------------------

_SITES_SHOWN = 10
_CATEGORY_COLOURS = {
    "parameters": "#2f6fdb",
    "gradients": "#7c3aed",
    "optimizer": "#0f766e",
    "activations": "#c2410c",
    "temporaries": "#ca8a04",
    "cublas_workspaces": "#db2777",
    "other": "#8c959f",
}


def _breakdown_section(tests: list[Mapping[str, Any]]) -> str:
    figures = []
    for test in tests:
        breakdown = test.get("breakdown")
        if isinstance(breakdown, Mapping) and isinstance(breakdown.get("categories"), Mapping):
            figures.append(_breakdown_figure(str(test.get("nodeid") or ""), breakdown))
    if not figures:
        return ""
    return (
        "<h2>What the peaks were made of</h2>\n"
        '<p class="note">What was live at each test\'s peak, by category and by module.</p>\n'
        '<div class="charts">' + "".join(figures) + "</div>\n"
    )


def _breakdown_figure(nodeid: str, breakdown: Mapping[str, Any]) -> str:
    categories = {str(k): as_int(v) or 0 for k, v in breakdown["categories"].items() if as_int(v)}
    total = sum(categories.values()) or 1
    bar, x = [], 0.0
    for name, size in categories.items():
        width = 600 * size / total
        colour = _CATEGORY_COLOURS.get(name, _OTHER_COLOUR)
        bar.append(
            f'<rect x="{x:.1f}" y="0" width="{width:.1f}" height="22" fill="{colour}">'
            f"<title>{_e(category_label(name))} {_e(format_size(size))}</title></rect>"
        )
        x += width
    legend = " · ".join(
        f'<span style="color:{_CATEGORY_COLOURS.get(n, _OTHER_COLOUR)}">&#9632;</span> '
        f"{_e(category_label(n))} {_e(format_size(v))}"
        for n, v in categories.items()
    )
    rows = []
    for module in breakdown.get("modules") or []:
        if not isinstance(module, Mapping):
            continue
        split = module.get("categories") if isinstance(module.get("categories"), Mapping) else {}
        parts = ", ".join(
            f"{category_label(str(k))} {format_size(as_int(v) or 0)}" for k, v in split.items()
        )
        rows.append(
            f'<tr><td class="test">{_e(module.get("name") or "")}</td>'
            f'<td class="num">{_e(size_text(module.get("bytes"), _MISSING))}</td>'
            f"<td>{_e(parts)}</td></tr>"
        )
    table = (
        '<table class="modules"><thead><tr><th>Module</th><th class="num">At the peak</th>'
        "<th>Categories</th></tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
        if rows
        else ""
    )
    return (
        f"<figure><h3>{_e(nodeid)}</h3><figcaption>{legend}</figcaption>"
        f'<svg viewBox="0 0 600 22" width="600" height="22" role="img">{"".join(bar)}</svg>'
        + table
        + "</figure>"
    )


def _lines_section(tests: list[Mapping[str, Any]]) -> str:
    """The lines of the user's code alive at the peak of each test that has them."""
    figures = []
    for test in tests:
        lines = test.get("peak_lines")
        if not isinstance(lines, list) or not lines:
            continue
        rows = "".join(
            f'<tr><td class="test">{_e(line.get("file"))}:{_e(line.get("line"))}</td>'
            f'<td class="test">{_e(line.get("text") or "")}</td>'
            f'<td class="num">{_e(size_text(line.get("bytes"), _MISSING))}</td>'
            f"<td>{_e(category_label(str(line.get('category') or '')))}</td></tr>"
            for line in lines
            if isinstance(line, Mapping)
        )
        figures.append(
            f"<figure><h3>{_e(test.get('nodeid') or '')}</h3><table><thead><tr><th>Line</th>"
            '<th>Source</th><th class="num">At the peak</th><th>Category</th></tr></thead>'
            f"<tbody>{rows}</tbody></table></figure>"
        )
    if not figures:
        return ""
    return (
        "<h2>Lines alive at the peak</h2>\n"
        '<p class="note">For each test whose memory check failed (every gated test under '
        "--vram-peak-lines=all): the lines of your code that allocated what was alive at its "
        "peak, largest first, taken on a rerun of the test."
        "</p>\n" + '<div class="charts">' + "".join(figures) + "</div>\n"
    )


# --- the table ----------------------------------------------------------------------------------


def _table_section(tests: list[Mapping[str, Any]]) -> str:
    if not tests:
        return ""
    rows = []
    for test in tests:
        status = str(test.get("status") or "")
        colour = _STATUS_COLOURS.get(status, _OTHER_COLOUR)
        change = change_text(test.get("change"), test.get("change_percent"), _MISSING)
        messages = "\n".join(str(m) for m in test.get("messages") or [])
        snapshot = snapshot_of(test)
        if snapshot is not None:
            messages += ("\n" if messages else "") + f"memory snapshot: {snapshot}"
        css = ' class="failing"' if status in FAILING_STATUSES else ""
        rows.append(
            f"<tr{css}>"
            f'<td class="test">{_e(test.get("nodeid") or "")}</td>'
            f"<td>{_e(test.get('backend') or '')}</td>"
            f"<td>{_e(test.get('device') or '')}</td>"
            f'<td class="num">{_e(size_text(test.get("peak_allocated"), _MISSING))}</td>'
            f'<td class="num">{_e(size_text(baseline_peak(test), _MISSING))}</td>'
            f'<td class="num">{_e(change)}</td>'
            f'<td class="num">{_e(size_text(test.get("leftover"), _MISSING))}</td>'
            f'<td><span class="badge" style="background:{colour}">{_e(status)}</span></td>'
            f'<td class="msg">{_e(messages)}</td>'
            "</tr>"
        )
    return (
        "<h2>All tests</h2>\n<table><thead><tr><th>Test</th><th>Backend</th><th>Device</th>"
        '<th class="num">Peak</th><th class="num">Baseline</th><th class="num">Change</th>'
        '<th class="num">Leftover</th><th>Status</th><th>Messages</th></tr></thead><tbody>\n'
        + "\n".join(rows)
        + "\n</tbody></table>\n"
    )
