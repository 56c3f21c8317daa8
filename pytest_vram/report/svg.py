"""The SVG drawing of the HTML report: axes with round ticks, and a line chart of a series.

Nothing here knows the report document: :mod:`pytest_vram.report.html` draws its charts with
these, and every text they draw is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from html import escape

from pytest_vram.units import format_size

__all__ = ["line_chart", "short_label", "size_ticks", "svg_start"]

# A leak check of thousands of steps is drawn from this many points (min and max per bucket).
_MAX_POINTS = 1200
_UNITS = (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024))


def _escape(value: object) -> str:
    return escape(str(value), quote=True)


def svg_start(width: int, height: int, label: str) -> str:
    """The opening tag of a chart ``width`` by ``height`` pixels, named ``label``."""
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 {width} {height}" width="{width}" '
        f'height="{height}" role="img" aria-label="{_escape(label)}">'
    )


def _unit(value: float) -> tuple[str, int]:
    for name, factor in _UNITS:
        if value >= factor:
            return name, factor
    return "B", 1


def _nice_step(raw: float) -> float:
    if raw <= 0:
        return 1.0
    magnitude = 10 ** math.floor(math.log10(raw))
    for multiple in (1, 2, 2.5, 5, 10):
        if multiple * magnitude >= raw * (1 - 1e-9):
            return multiple * magnitude
    return 10 * magnitude  # pragma: no cover - the loop always returns


def _decimals(step: float) -> int:
    text = f"{step:.6f}".rstrip("0").rstrip(".")
    return len(text.split(".")[1]) if "." in text else 0


def size_ticks(lo: float, hi: float, count: int = 5) -> tuple[list[tuple[float, str]], int]:
    """Round ticks that cover ``lo`` to ``hi`` (bytes), labelled in one IEC unit.

    Returns the ticks and an offset: a few KiB of growth on a 40 GiB baseline would need a dozen
    decimals, so when two do not tell the ticks apart they are labelled as growth above ``lo``
    (``+4.00 KiB``) and the offset is ``lo``; otherwise it is 0.
    """
    name, factor = _unit(max(abs(lo), abs(hi)))
    step = _nice_step((hi - lo) / factor / count)
    if step < 0.01 and lo > 0:
        ticks, _ = size_ticks(0, hi - lo, count)
        return [(lo + position, "+" + label) for position, label in ticks], int(lo)
    if name == "B":
        step = max(1.0, math.ceil(step))
    digits = _decimals(step)
    first = math.floor(lo / factor / step + 1e-9)
    last = math.ceil(hi / factor / step - 1e-9)
    ticks = [
        (index * step * factor, f"{index * step:.{digits}f} {name}")
        for index in range(first, last + 1)
    ]
    return ticks, 0


def _int_ticks(lo: int, hi: int, count: int = 6) -> list[int]:
    step = max(1, math.ceil(_nice_step((hi - lo) / count)))
    first = math.ceil(lo / step) * step
    return list(range(first, hi + 1, step))


def short_label(text: str, width: int) -> str:
    """``text`` cut to ``width`` characters, keeping its end."""
    # Keep the end of a node id: the test name and parameters tell tests apart, the path less so.
    return text if len(text) <= width else "…" + text[-(width - 1) :]


def _downsample(series: Sequence[int]) -> list[tuple[int, int]]:
    """(step, bytes) points, at most about ``_MAX_POINTS``, keeping each bucket's extremes."""
    if len(series) <= _MAX_POINTS:
        return [(i + 1, v) for i, v in enumerate(series)]
    bucket = math.ceil(len(series) / (_MAX_POINTS // 2))
    points = []
    for start in range(0, len(series), bucket):
        chunk = series[start : start + bucket]
        low = min(range(len(chunk)), key=chunk.__getitem__)
        high = max(range(len(chunk)), key=chunk.__getitem__)
        for offset in sorted({low, high}):
            points.append((start + offset + 1, chunk[offset]))
    return points


def line_chart(series: Sequence[int], colour: str) -> str:
    width, height = 520, 240
    lo, hi = min(series), max(series)
    if lo == hi:
        # A flat series still needs a y range; centre it so the line reads as flat, not as zero.
        pad = max(512, lo // 50)
        lo, hi = max(0, lo - pad), hi + pad
    ticks, offset = size_ticks(lo, hi)
    lo, hi = ticks[0][0], ticks[-1][0]
    steps = len(series)
    # Offset labels need a line above the plot that says what they are offsets from.
    left, right, top, bottom = 78, width - 14, 28 if offset else 12, height - 38

    def x(step: float) -> float:
        return left + (right - left) * ((step - 1) / (steps - 1) if steps > 1 else 0.5)

    def y(value: float) -> float:
        return bottom - (bottom - top) * (value - lo) / (hi - lo)

    svg = [svg_start(width, height, "Allocated bytes per step")]
    for value, label in ticks:
        py = y(value)
        svg.append(
            f'<line x1="{left}" y1="{py:.1f}" x2="{right}" y2="{py:.1f}" stroke="#eaeef2"/>'
            f'<text x="{left - 6}" y="{py + 4:.1f}" text-anchor="end">{_escape(label)}</text>'
        )
    for step in _int_ticks(1, steps):
        px = x(step)
        svg.append(
            f'<line x1="{px:.1f}" y1="{bottom}" x2="{px:.1f}" y2="{bottom + 4}" stroke="#8c959f"/>'
            f'<text x="{px:.1f}" y="{bottom + 16}" text-anchor="middle">{step}</text>'
        )
    svg.append(
        f'<line x1="{left}" y1="{top}" x2="{left}" y2="{bottom}" stroke="#8c959f"/>'
        f'<line x1="{left}" y1="{bottom}" x2="{right}" y2="{bottom}" stroke="#8c959f"/>'
        f'<text x="{(left + right) / 2:.1f}" y="{height - 4}" text-anchor="middle">step</text>'
        f'<text transform="translate(12 {(top + bottom) / 2:.1f}) rotate(-90)" '
        'text-anchor="middle">allocated</text>'
    )
    if offset:
        svg.append(
            f'<text x="{left - 6}" y="14">growth above {_escape(format_size(offset))} '
            f"({offset:,} bytes)</text>"
        )
    points = _downsample(series)
    path = " ".join(f"{x(s):.1f},{y(v):.1f}" for s, v in points)
    svg.append(
        f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2" '
        'stroke-linejoin="round"/>'
    )
    if len(points) <= 60:
        svg.extend(
            f'<circle cx="{x(s):.1f}" cy="{y(v):.1f}" r="2.5" fill="{colour}">'
            f"<title>step {s}: {_escape(format_size(v))} ({v:,} bytes)</title></circle>"
            for s, v in points
        )
    svg.append("</svg>")
    return "".join(svg)
