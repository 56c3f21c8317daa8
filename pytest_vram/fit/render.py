"""``pytest-vram fit --html``: the table and a chart of the largest batch per GPU size."""

from __future__ import annotations

from html import escape
from pathlib import Path

from pytest_vram.atomic import write_atomic
from pytest_vram.fit.table import FitTable, cheapest
from pytest_vram.report.html import PAGE_CSS

__all__ = ["render_fit_html", "write_html"]

_COLOURS = ("#2f6fdb", "#e4572e", "#2e9d5b", "#9b59b6", "#c2410c", "#7f9c8c", "#d1495b")


def write_html(table: FitTable, path: Path) -> None:
    write_atomic(path, render_fit_html(table))


def render_fit_html(table: FitTable) -> str:
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        "<title>pytest-vram fit</title>\n"
        f"<style>{PAGE_CSS}</style>\n</head>\n<body>\n<h1>What fits</h1>\n"
        '<p class="meta">the largest micro-batch whose training step fits each GPU size, found '
        "on the simulated device; the estimator's answer dashed</p>\n"
        f"{_chart(table)}{_table(table)}</body>\n</html>\n"
    )


def _chart(table: FitTable) -> str:
    width, height, left, bottom, top = 640, 280, 48, 36, 12
    groups = len(table.capacities)
    bars = max(1, len(table.rows))
    most = max([1] + [fit.value for row in table.rows for fit in row.fits]
               + [e or 0 for row in table.rows for e in row.estimated])  # fmt: skip
    span = (width - left - 8) / groups
    bar = span * 0.8 / bars

    def y(value: float) -> float:
        return top + (height - top - bottom) * (1 - value / most)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" '
        f'width="{width}" height="{height}" role="img" aria-label="largest batch per GPU size">'
    ]
    for tick in sorted({0, most // 2, most}):
        parts.append(
            f'<text x="{left - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">{tick}</text>'
            f'<line x1="{left}" x2="{width - 8}" y1="{y(tick):.1f}" y2="{y(tick):.1f}" '
            'stroke="#d0d7de"/>'
        )
    for g, text in enumerate(table.capacities):
        x0 = left + g * span + span * 0.1
        for b, row in enumerate(table.rows):
            colour = _COLOURS[b % len(_COLOURS)]
            value = row.fits[g].value
            x = x0 + b * bar
            parts.append(
                f'<rect x="{x:.1f}" y="{y(value):.1f}" width="{bar * 0.9:.1f}" '
                f'height="{y(0) - y(value):.1f}" fill="{colour}">'
                f"<title>{escape(row.layout.label)} on {escape(text)}: {value}</title></rect>"
            )
            estimated = row.estimated[g]
            if estimated is not None:
                parts.append(
                    f'<line x1="{x:.1f}" x2="{x + bar * 0.9:.1f}" y1="{y(estimated):.1f}" '
                    f'y2="{y(estimated):.1f}" stroke="#1f2328" stroke-dasharray="3 2"/>'
                )
        parts.append(
            f'<text x="{x0 + span * 0.4:.1f}" y="{height - bottom + 16}" '
            f'text-anchor="middle">{escape(text)}</text>'
        )
    parts.append("</svg>")
    legend = "".join(
        f'<span><i style="background:{_COLOURS[b % len(_COLOURS)]}"></i>'
        f"{escape(row.layout.label)}</span>"
        for b, row in enumerate(table.rows)
    )
    return f'<figure><div class="legend">{legend}</div>{"".join(parts)}</figure>\n'


def _table(table: FitTable) -> str:
    head = "".join(f"<th>{escape(row.layout.label)}</th>" for row in table.rows)
    lines = [f"<h2>Largest micro-batch</h2>\n<table><tr><th>GPU</th>{head}"
             "<th>cheapest that fits</th></tr>"]  # fmt: skip
    for i, text in enumerate(table.capacities):
        cells = []
        for row in table.rows:
            estimated = row.estimated[i]
            shown = str(row.fits[i].value)
            if estimated is not None:
                shown += f" <span class='note'>(estimate {estimated})</span>"
            cells.append(f'<td class="num">{shown}</td>')
        best = cheapest(table.rows, i)
        label = escape(best.layout.label) if best is not None else "none"
        lines.append(f"<tr><td>{escape(text)}</td>{''.join(cells)}<td>{label}</td></tr>")
    lines.append("</table>\n")
    return "\n".join(lines)
