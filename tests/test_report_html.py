"""The self-contained HTML report."""

from __future__ import annotations

import copy
import importlib.util
import re
import struct
import zlib
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType
from typing import Any
from xml.etree import ElementTree

import pytest

from pytest_vram.report.html import MAX_BARS, render_html
from pytest_vram.report.svg import size_ticks

ROOT = Path(__file__).resolve().parent.parent
GiB = 1024**3
MiB = 1024**2
SVG = "{http://www.w3.org/2000/svg}"


def _load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "screenshot_html", ROOT / "scripts" / "screenshot_html.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


screenshot_html = _load_script()


@pytest.fixture
def document() -> dict[str, Any]:
    return screenshot_html.sample_document()


def _svgs(page: str) -> list[ElementTree.Element]:
    """Each inline SVG, parsed as XML: a stray ``<`` or ``&`` would not parse."""
    return [ElementTree.fromstring(m) for m in re.findall(r"<svg .*?</svg>", page, re.S)]


class _Balance(HTMLParser):
    """Counts open tags, to catch markup broken by an unescaped string."""

    VOID = frozenset({"meta", "br", "img", "input", "link", "hr"})

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.errors: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        pass

    def handle_endtag(self, tag: str) -> None:
        if not self.stack or self.stack.pop() != tag:
            self.errors.append(tag)


def test_page_is_balanced_and_svgs_are_well_formed(document: dict[str, Any]) -> None:
    page = render_html(document)
    assert page.startswith("<!DOCTYPE html>")
    parser = _Balance()
    parser.feed(page)
    assert parser.errors == [] and parser.stack == []
    assert len(_svgs(page)) == 3  # the peak chart and two leak checks


def test_self_contained(document: dict[str, Any]) -> None:
    page = render_html(document)
    urls = set(re.findall(r"https?://[^\s\"'<>)]+", page))
    assert urls == {"http://www.w3.org/2000/svg"}  # a namespace name, never fetched
    for needle in ("<script", "<link", "<img", "src=", "@import", "url(", "@font-face"):
        assert needle not in page


def test_cards_mark_the_failing_statuses(document: dict[str, Any]) -> None:
    document["totals"] = {"measured": 6, "regression": 1, "leak": 1, "ok": 2, "regressions": 2}
    page = render_html(document)
    cards = re.findall(r'<div class="card( bad)?"><b>(\d+)</b><span>([^<]*)</span>', page)
    assert cards == [
        ("", "6", "measured"),
        (" bad", "1", "leak"),
        (" bad", "1", "regression"),
        ("", "2", "ok"),
        ("", "2", "regressions"),
    ]


def test_environment_table(document: dict[str, Any]) -> None:
    page = render_html(document)
    assert (
        "<tr><th>Backend</th><th>Device</th><th>torch</th><th>CUDA</th><th>Driver</th>"
        '<th class="num">Total memory</th></tr>'
    ) in page
    assert "<td>cuda</td><td>NVIDIA H100 80GB HBM3</td>" in page


def test_every_document_string_is_escaped(document: dict[str, Any]) -> None:
    hostile = "t.py::test_x[<script>alert(\"x\")</script>&'q'<b>]"
    test = copy.deepcopy(document["tests"][1])  # the leak check, so it is in every section
    test["nodeid"] = hostile
    test["backend"] = '"><img src=x>'
    test["device"] = "<i>gpu</i>"
    test["status"] = "<u>ok</u>"
    test["messages"] = ["</td></tr></table><h1>owned</h1>"]
    test["scenarios"]["leak_check"]["tolerance"] = "<5%>"
    document["tests"] = [test]
    document["environments"]["cuda"]["driver"] = "</td><script>"
    document["created"] = "<now>"
    page = render_html(document)
    for raw in ("<script", "<img", "<i>", "<u>", "<h1>owned", "<b>]", "<now>", "<5%>"):
        assert raw not in page
    assert (
        "t.py::test_x[&lt;script&gt;alert(&quot;x&quot;)&lt;/script&gt;&amp;&#x27;q&#x27;" in page
    )
    parser = _Balance()
    parser.feed(page)
    assert parser.errors == [] and parser.stack == []
    _svgs(page)


def test_leak_charts_have_iec_axes(document: dict[str, Any]) -> None:
    page = render_html(document)
    leak_tests = [t for t in document["tests"] if "leak_check" in t["scenarios"]]
    charts = [svg for svg in _svgs(page) if svg.get("aria-label") == "Allocated bytes per step"]
    assert len(charts) == len(leak_tests) == 2
    for chart, test in zip(charts, leak_tests, strict=True):
        labels = [t.text or "" for t in chart.iter(f"{SVG}text")]
        y_labels = [
            label for label in labels if re.fullmatch(r"\d+(\.\d+)? (B|KiB|MiB|GiB)", label)
        ]
        assert len(y_labels) >= 3
        assert "step" in labels and "allocated" in labels
        (line,) = chart.iter(f"{SVG}polyline")
        points = line.get("points", "").split()
        assert len(points) == len(test["scenarios"]["leak_check"]["per_step"])
    leaking = charts[0]
    # Higher memory is drawn higher: SVG y grows downwards, and this series grows.
    ys = [
        float(p.split(",")[1]) for p in next(leaking.iter(f"{SVG}polyline")).get("points").split()
    ]
    assert ys[0] > ys[-1]
    assert "growth +320.00 MiB · +8.00 MiB per step · 40 steps · 3 warm-up · tolerance 0 B" in page


def test_small_growth_on_a_large_footprint_uses_offset_labels(document: dict[str, Any]) -> None:
    leak = document["tests"][1]["scenarios"]["leak_check"]
    leak["per_step"] = [40 * GiB + 512 * step for step in range(100)]
    page = render_html(document)
    assert "growth above 40.00 GiB (42,949,672,960 bytes)" in page
    assert ">+40 KiB</text>" in page


def test_long_series_are_downsampled(document: dict[str, Any]) -> None:
    leak = document["tests"][1]["scenarios"]["leak_check"]
    leak["per_step"] = [GiB + (step % 7) * MiB for step in range(20_000)]
    page = render_html(document)
    chart = next(s for s in _svgs(page) if s.get("aria-label") == "Allocated bytes per step")
    points = next(chart.iter(f"{SVG}polyline")).get("points", "").split()
    assert 100 < len(points) <= 1300
    assert ">20000</text>" in page  # the x axis still spans every step


def test_peak_chart_bars_and_baseline_markers(document: dict[str, Any]) -> None:
    page = render_html(document)
    chart = next(s for s in _svgs(page) if "baseline" in (s.get("aria-label") or ""))
    bars = list(chart.iter(f"{SVG}rect"))
    assert len(bars) == len(document["tests"])
    markers = [line for line in chart.iter(f"{SVG}line") if line.get("stroke-width") == "2.5"]
    assert len(markers) == sum(1 for t in document["tests"] if t["baseline"])
    widths = {float(bar.get("width")) for bar in bars}
    assert max(widths) == float(bars[0].get("width"))  # the 19 GiB regression is the widest
    labels = [t.text for t in chart.iter(f"{SVG}text")]
    assert "0 GiB" in labels and "20 GiB" in labels


def test_peak_chart_is_capped(document: dict[str, Any]) -> None:
    template = document["tests"][2]
    document["tests"] = []
    for i in range(MAX_BARS + 15):
        test = copy.deepcopy(template)
        test["nodeid"] = f"t::test_{i}"
        document["tests"].append(test)
    page = render_html(document)
    chart = next(s for s in _svgs(page) if "baseline" in (s.get("aria-label") or ""))
    assert len(list(chart.iter(f"{SVG}rect"))) == MAX_BARS
    assert f"The {MAX_BARS} tests listed first of {MAX_BARS + 15}" in page
    assert page.count('<td class="test">') == MAX_BARS + 15


def test_table_lists_every_test(document: dict[str, Any]) -> None:
    page = render_html(document)
    assert page.count('<td class="test">') == len(document["tests"])
    assert "+2.00 GiB (+11.8%)" in page
    assert "-512.00 MiB (-12.5%)" in page
    assert '<tr class="failing"><td class="test">suites/test_training.py' in page


def test_empty_and_sparse_documents() -> None:
    page = render_html({})
    assert "No test was measured." in page
    sparse = {"tests": [{"nodeid": "t::x", "peak_allocated": 5, "scenarios": {"leak_check": {}}}]}
    page = render_html(sparse)
    assert ">5 B</td>" in page
    _svgs(page)


@pytest.mark.parametrize(
    ("lo", "hi"),
    [
        (0, 19 * GiB),
        (1200 * MiB, 1520 * MiB),
        (768 * MiB, 792 * MiB),
        (0, 1),
        (0, 300),
        (5, 1028),
        (40 * GiB, 40 * GiB + 3 * 1024),
        (2**40, 2**40 + 3),
    ],
)
def test_ticks_cover_the_range_with_distinct_labels(lo: int, hi: int) -> None:
    ticks, offset = size_ticks(lo, hi)
    positions = [position for position, _ in ticks]
    labels = [label for _, label in ticks]
    assert positions[0] <= lo and positions[-1] >= hi
    assert len(set(labels)) == len(labels)
    assert 2 <= len(ticks) <= 12
    assert offset in (0, lo)


def _png_pixels_vary(path: Path) -> bool:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", data[16:24])
    assert (width, height) == (1200, 1600)
    chunks, offset = [], 8
    while offset < len(data):
        (length,) = struct.unpack(">I", data[offset : offset + 4])
        kind = data[offset + 4 : offset + 8]
        if kind == b"IDAT":
            chunks.append(data[offset + 8 : offset + 8 + length])
        offset += 12 + length
    raw = zlib.decompress(b"".join(chunks))
    # A blank page compresses to a few repeated byte values; a rendered report does not.
    return len(set(raw)) > 64 and len(raw) > 1000


@pytest.mark.slow
def test_renders_in_headless_chromium(tmp_path: Path, document: dict[str, Any]) -> None:
    if screenshot_html.find_chromium() is None:
        pytest.skip("chromium is not installed")
    page = tmp_path / "vram.html"
    page.write_text(render_html(document), encoding="utf-8")
    png = tmp_path / "vram.png"
    screenshot_html.screenshot(page, png)
    assert _png_pixels_vary(png)
