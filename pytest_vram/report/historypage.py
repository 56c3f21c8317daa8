"""The history page: per test, its peak over the commits, with the commits where it stepped up
marked; in the style of the HTML report and as self-contained (inline CSS and SVG, no script).

Every text taken from a document (test names, commit names, dates) is escaped.
"""

from __future__ import annotations

from html import escape

from pytest_vram.report.history import History, Step, ordered_tests
from pytest_vram.report.html import PAGE_CSS
from pytest_vram.report.svg import size_ticks, svg_start
from pytest_vram.report.text import change_text, plural, size_text
from pytest_vram.units import format_size

__all__ = ["MAX_CHARTS", "render_history_html"]

#: Charts drawn: the tests that stepped up first, then the largest peaks.
MAX_CHARTS = 300
#: Rows in the table of the largest steps.
MAX_STEPS = 50

_LINE = "#2f6fdb"
_STEP = "#d1495b"
_CSS = (
    PAGE_CSS
    + """
.chart-head { display: flex; justify-content: space-between; gap: 8px; }
.chart-head span { color: var(--muted); font-size: 12px; white-space: nowrap; }
"""
)


def _e(value: object) -> str:
    return escape(str(value), quote=True)


def render_history_html(history: History, max_charts: int = MAX_CHARTS) -> str:
    """The page, as one self-contained HTML string."""
    steps = history.steps_by_test()
    names = ordered_tests(history)
    drawn = names[:max_charts]
    parts = [
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        "<title>pytest-vram history</title>\n"
        f"<style>{_CSS}</style>\n</head>\n<body>\n",
        "<h1>GPU memory over the commits</h1>\n",
        _meta(history),
        _cards(history, len(steps)),
        _steps_table(history),
        '<h2>Peak allocated per commit</h2>\n<div class="legend"><span><i style="background:'
        f'{_LINE}"></i>peak allocated</span><span><i class="marker" style="background:{_STEP}">'
        f"</i>a step up beyond {_e(history.tolerance)}</span></div>\n",
        '<div class="charts">\n',
        "".join(_figure(history, name, steps.get(name, [])) for name in drawn),
        "</div>\n",
    ]
    if len(names) > len(drawn):
        parts.append(
            f'<p class="note">{_e(plural(len(names) - len(drawn), "more test"))} not drawn '
            f"(the {len(drawn)} drawn are those that stepped up, then the largest peaks).</p>\n"
        )
    parts.append("</body>\n</html>\n")
    return "".join(parts)


def _meta(history: History) -> str:
    first, last = history.commits[0], history.commits[-1]
    span = f"{_e(first.short)} ({_e(first.date[:10] or '?')})"
    if len(history.commits) > 1:
        span += f" to {_e(last.short)} ({_e(last.date[:10] or '?')})"
    return (
        f'<p class="meta">{_e(plural(len(history.commits), "commit"))}, {span}; a step is a '
        f"rise beyond {_e(history.tolerance)} over the commit before.</p>\n"
    )


def _cards(history: History, stepped: int) -> str:
    cards = [
        ("", len(history.series), "gated tests"),
        ("", len(history.commits), "commits"),
        ("bad" if history.steps else "", len(history.steps), "steps up"),
        ("bad" if stepped else "", stepped, "tests that stepped up"),
    ]
    return (
        '<div class="cards">'
        + "".join(
            f'<div class="card {kind}"><b>{count}</b><span>{_e(label)}</span></div>'
            for kind, count, label in cards
        )
        + "</div>\n"
    )


def _steps_table(history: History) -> str:
    if not history.steps:
        return '<h2>Largest steps</h2>\n<p class="note">No test stepped up.</p>\n'
    rows = []
    for step in history.steps[:MAX_STEPS]:
        commit = history.commits[step.commit]
        rows.append(
            f'<tr><td class="test">{_e(step.test)}</td>'
            f'<td class="test" title="{_e(commit.name)}">{_e(commit.short)}</td>'
            f"<td>{_e(commit.date[:10])}</td>"
            f'<td class="num">{_e(size_text(step.before))}</td>'
            f'<td class="num">{_e(size_text(step.after))}</td>'
            f'<td class="num">{_e(change_text(step.delta, step.percent))}</td></tr>\n'
        )
    more = len(history.steps) - len(rows)
    note = f'<p class="note">{_e(plural(more, "more step"))} not listed.</p>\n' if more else ""
    return (
        "<h2>Largest steps</h2>\n<table><thead><tr><th>Test</th><th>Commit</th><th>Date</th>"
        '<th class="num">Before</th><th class="num">After</th><th class="num">Step</th></tr>'
        "</thead><tbody>\n" + "".join(rows) + "</tbody></table>\n" + note
    )


def _figure(history: History, name: str, steps: list[Step]) -> str:
    values = history.series[name]
    latest = next((v for v in reversed(values) if v is not None), None)
    caption = f"latest {size_text(latest)}"
    if steps:
        caption += f"; {plural(len(steps), 'step')} up"
    return (
        f'<figure><div class="chart-head"><h3>{_e(name)}</h3><span>{_e(caption)}</span></div>'
        f"{_chart(history, name, values, steps)}</figure>\n"
    )


def _chart(history: History, name: str, values: list[int | None], steps: list[Step]) -> str:
    width, height = 520, 220
    # From zero: a step reads against the whole peak, and commit-to-commit noise stays flat.
    lo, hi = 0, max(v for v in values if v is not None) or 1024
    ticks, offset = size_ticks(lo, hi)
    lo, hi = ticks[0][0], ticks[-1][0]
    count = len(values)
    left, right, top, bottom = 78, width - 14, 28 if offset else 12, height - 38

    def x(index: int) -> float:
        return left + (right - left) * (index / (count - 1) if count > 1 else 0.5)

    def y(value: float) -> float:
        return bottom - (bottom - top) * (value - lo) / (hi - lo)

    svg = [svg_start(width, height, f"Peak allocated of {name} per commit")]
    for value, label in ticks:
        py = y(value)
        svg.append(
            f'<line x1="{left}" y1="{py:.1f}" x2="{right}" y2="{py:.1f}" stroke="#eaeef2"/>'
            f'<text x="{left - 6}" y="{py + 4:.1f}" text-anchor="end">{_e(label)}</text>'
        )
    labelled = _commit_ticks(count)
    for index in labelled:
        px = x(index)
        # The first and last labels stay inside the chart.
        anchor = "start" if index == 0 and count > 1 else "middle"
        if index == count - 1 and count > 1:
            anchor = "end"
        svg.append(
            f'<line x1="{px:.1f}" y1="{bottom}" x2="{px:.1f}" y2="{bottom + 4}" stroke="#8c959f"/>'
            f'<text x="{px:.1f}" y="{bottom + 16}" text-anchor="{anchor}">'
            f"{_e(history.commits[index].short[:7])}</text>"
        )
    svg.append(
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#8c959f"/>'
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#8c959f"/>'
        f'<text x="{(left + right) / 2:.1f}" y="{height - 4}" text-anchor="middle">'
        "commit, oldest to newest</text>"
    )
    if offset:
        svg.append(
            f'<text x="{left - 6}" y="14">growth above {_e(format_size(offset))} '
            f"({offset:,} bytes)</text>"
        )
    for step in steps:
        px, commit = x(step.commit), history.commits[step.commit]
        svg.append(
            f'<line x1="{px:.1f}" y1="{top}" x2="{px:.1f}" y2="{bottom}" stroke="{_STEP}" '
            'stroke-dasharray="3 3"/>'
            f'<circle cx="{px:.1f}" cy="{y(step.after):.1f}" r="4" fill="{_STEP}">'
            f"<title>{_e(commit.short)} {_e(commit.date[:10])}: "
            f"{_e(change_text(step.delta, step.percent))} to {_e(size_text(step.after))}"
            "</title></circle>"
        )
    # A commit that did not run the test breaks the line rather than bridging it.
    run: list[str] = []
    for index, value in enumerate(values):
        if value is None:
            svg.append(_polyline(run))
            run = []
        else:
            run.append(f"{x(index):.1f},{y(value):.1f}")
    svg.append(_polyline(run))
    svg.append("</svg>")
    return "".join(svg)


def _polyline(points: list[str]) -> str:
    if not points:
        return ""
    if len(points) == 1:
        cx, cy = points[0].split(",")
        return f'<circle cx="{cx}" cy="{cy}" r="2.5" fill="{_LINE}"/>'
    return (
        f'<polyline points="{" ".join(points)}" fill="none" stroke="{_LINE}" stroke-width="2" '
        'stroke-linejoin="round"/>'
    )


def _commit_ticks(count: int, most: int = 5) -> list[int]:
    """Up to ``most`` commits to label, evenly spread, the first and the last included."""
    if count <= most:
        return list(range(count))
    return sorted({round(i * (count - 1) / (most - 1)) for i in range(most)})
