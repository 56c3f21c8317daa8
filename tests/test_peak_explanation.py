"""``pytest-vram compare`` explains each change beyond the tolerance: the categories, modules and
lines that changed at the peak, in the terminal and in the comment's ``<details>``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.cli import main
from pytest_vram.report.comparison import MARKER, render_comparison
from pytest_vram.report.peakchange import explain, explanation_lines, largest_rows
from pytest_vram.report.runcomparison import compare_runs

MiB = 1 << 20


def _row(name: str, peak: int, **extra: Any) -> dict[str, Any]:
    return {"name": name, "vram_peak_allocated": peak, "vram_status": "ok", **extra}


def _categories(**sizes: int) -> dict[str, int]:
    return {name: size * MiB for name, size in sizes.items()}


def _line(file: str, line: int, text: str, size: int, category: str = "activations") -> dict:
    return {"file": file, "line": line, "text": text, "bytes": size * MiB, "category": category}


BASE = _row(
    "t::step",
    100 * MiB,
    vram_categories=_categories(parameters=10, activations=40, temporaries=20),
    vram_modules={"blocks.0": 20 * MiB, "blocks.1": 20 * MiB},
    vram_peak_lines=[_line("model.py", 50, "h = self.mlp(x)", 30)],
)
HEAD = _row(
    "t::step",
    160 * MiB,
    vram_categories=_categories(parameters=10, activations=110, temporaries=10),
    vram_modules={"blocks.0": 50 * MiB, "blocks.1": 20 * MiB, "head": 5 * MiB},
    vram_peak_lines=[
        # The line moved down by two: the same line, matched by its text.
        _line("model.py", 52, "h = self.mlp(x)", 40),
        _line("model.py", 54, "attn = q @ k.transpose(-2, -1)", 60),
    ],
)


def test_explain_gives_categories_modules_and_lines_that_grew() -> None:
    explanation = explain(BASE, HEAD)
    assert explanation.categories == [("activations", 70 * MiB), ("temporaries", -10 * MiB)]
    assert explanation.unchanged == ["parameters"]
    assert explanation.modules == [("blocks.0", 30 * MiB), ("head", 5 * MiB)]
    assert [(line.location, line.text, line.delta) for line in explanation.lines] == [
        ("model.py:54", "attn = q @ k.transpose(-2, -1)", 60 * MiB),
        ("model.py:52", "h = self.mlp(x)", 10 * MiB),
    ]


def test_explain_without_both_sides() -> None:
    head_only = explain(_row("t::step", 1), HEAD)
    assert head_only.categories is None and head_only.modules == [] and head_only.lines == []
    assert head_only.head_categories == _categories(parameters=10, activations=110, temporaries=10)
    assert [line.head for line in head_only.head_lines] == [60 * MiB, 40 * MiB]
    assert explain(_row("t::step", 1), _row("t::step", 2)).empty
    assert explain(BASE, None).empty


def test_largest_rows_keeps_each_tests_largest_peak() -> None:
    rows = [_row("t::a", 5, backend="cpu"), _row("t::a", 9, backend="sim"), {"name": "t::b"}]
    assert largest_rows(rows) == {"t::a": rows[1]}


def test_the_comment_has_a_details_section_per_change() -> None:
    base = [BASE, _row("t::same", 10 * MiB, vram_categories=_categories(other=10))]
    head = [HEAD, _row("t::same", 10 * MiB, vram_categories=_categories(other=10))]
    text = render_comparison(compare_runs(base, head), base, head)
    section = text.split("#### What changed at the peak\n", 1)[1]
    assert section.count("<details>") == 1 and section.count("</details>") == 1
    assert "<summary><code>t::step</code>: +60.00 MiB (+60.0%)</summary>" in section
    assert (
        "At the peak, against the base: activations +70.00 MiB; temporaries -10.00 MiB; "
        "parameters unchanged"
    ) in section
    assert "Modules that grew: `blocks.0` +30.00 MiB, `head` +5.00 MiB" in section
    assert "- `model.py:54` `attn = q @ k.transpose(-2, -1)`: +60.00 MiB (activations)" in section
    # A blank line after the summary and before the end: GitHub renders the Markdown inside.
    assert re.search(r"</summary>\n\n\S", section) and "\n\n</details>" in section


def test_a_change_within_the_tolerance_is_not_explained() -> None:
    head = {**HEAD, "vram_peak_allocated": 102 * MiB}
    text = render_comparison(compare_runs([BASE], [head]), [BASE], [head])
    assert "<details>" not in text and "grown within the tolerance" in text


def test_a_shrunk_peak_is_explained_too() -> None:
    text = render_comparison(compare_runs([HEAD], [BASE]), [HEAD], [BASE])
    assert "<summary><code>t::step</code>: -60.00 MiB (-37.5%)</summary>" in text
    assert "activations -70.00 MiB" in text


def test_reports_without_categories_say_so_once() -> None:
    base, head = [_row("t::a", MiB), _row("t::b", MiB)], [_row("t::a", 3 * MiB), _row("t::b", 0)]
    text = render_comparison(compare_runs(base, head), base, head)
    assert "<details>" not in text
    assert "_2 tests without what was alive at the peak in both reports" in text


def test_sections_that_do_not_fit_are_left_out_whole() -> None:
    base = [{**BASE, "name": f"t::step{i}"} for i in range(40)]
    head = [{**HEAD, "name": f"t::step{i}"} for i in range(40)]
    text = render_comparison(compare_runs(base, head), base, head, max_chars=8_000)
    assert len(text) <= 8_000
    assert text.count("<details>") == text.count("</details>") > 0
    assert text.endswith("_More tests changed at the peak; the comment has no room for them._\n")


CRAFTED = "@octocat #1 deadbeefcafe1234 https://evil.example <img src=x onerror=alert(1)>"


def test_crafted_names_stay_text() -> None:
    base = [
        {
            **BASE,
            "name": CRAFTED,
            "vram_modules": {CRAFTED: MiB},
            "vram_peak_lines": [_line(CRAFTED, 1, CRAFTED, 1, CRAFTED)],
        }
    ]
    head = [
        {
            **HEAD,
            "name": CRAFTED,
            "vram_modules": {CRAFTED: 9 * MiB, "x`|<b>": 2 * MiB},
            "vram_peak_lines": [_line(CRAFTED, 1, CRAFTED, 9, CRAFTED)],
        }
    ]
    text = render_comparison(compare_runs(base, head), base, head)
    section = text.split("#### What changed at the peak\n", 1)[1]
    # Outside code spans and our own tags, nothing is live or markup.
    outside = re.sub(r"(`+)(?:(?!\1).)+?\1", "", section)
    outside = re.sub(r"<code>[^<]*</code>", "", outside)
    outside = re.sub(r"</?(details|summary)>", "", outside)
    assert "<" not in outside.replace("&lt;", "")
    assert not re.search(r"(?<![\w`])@[A-Za-z0-9]|#\d|\b[0-9a-f]{7,}\b|://", outside)
    # The summary's name is escaped HTML, never a tag.
    assert "<code>@octocat #1 deadbeefcafe1234 https://evil.example &lt;img" in section


def test_the_terminal_explains_each_change() -> None:
    lines = explanation_lines(compare_runs([BASE], [HEAD]).beyond, [BASE], [HEAD])
    assert lines == [
        "at the peak of t::step:",
        "  categories: activations +70.00 MiB; temporaries -10.00 MiB; parameters unchanged",
        "  modules that grew: blocks.0 +30.00 MiB, head +5.00 MiB",
        "  line grew: model.py:54 attn = q @ k.transpose(-2, -1): +60.00 MiB (activations)",
        "  line grew: model.py:52 h = self.mlp(x): +10.00 MiB (activations)",
        "",
    ]


# A model whose forward keeps more activations at the head: the cpu backend takes the category
# totals of every test, and the modules under --vram-breakdown.
MODEL = """
import torch
from torch import nn

WIDE = {wide}

class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(256, 256) for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if WIDE:
                x = x.repeat(1, 4)[:, :256]
        return x

def test_forward(vram):
    model = Model()
    x = torch.ones(512, 256)
    vram.single_step(lambda: model(x).sum().backward())
"""


@pytest.mark.slow
def test_compare_explains_a_real_regression(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    for side, wide in (("base", False), ("head", True)):
        pytester.makepyfile(test_model=MODEL.format(wide=wide))
        result = pytester.runpytest(
            "--vram-backend=cpu", "--vram-breakdown", f"--vram-json={side}.json"
        )
        assert (Path(pytester.path) / f"{side}.json").is_file(), result.outlines
    capsys.readouterr()
    status = main(["compare", "base.json", "head.json", "--markdown"])
    out = capsys.readouterr().out
    assert status == 1 and out.startswith(MARKER)
    section = out.split("#### What changed at the peak\n", 1)[1]
    assert "<summary><code>test_model.py::test_forward</code>" in section
    assert re.search(r"activations \+\d", section)
    assert re.search(r"Modules that grew: `Model` \+", section)
    status = main(["compare", "base.json", "head.json"])
    out = capsys.readouterr().out
    assert "at the peak of test_model.py::test_forward:" in out
    assert re.search(r"categories: activations \+", out)


def test_a_junit_files_lines_are_compared_too() -> None:
    base = _row(
        "t::step", 100 * MiB, vram_peak_line_1="31457280 activations model.py:50 h = self.mlp(x)"
    )
    head = _row(
        "t::step",
        160 * MiB,
        vram_peak_line_1="62914560 activations model.py:54 attn = q @ k.transpose(-2, -1)",
        vram_peak_line_2="41943040 activations model.py:52 h = self.mlp(x)",
    )
    explanation = explain(base, head)
    assert [(line.location, line.delta) for line in explanation.lines] == [
        ("model.py:54", 60 * MiB),
        ("model.py:52", 10 * MiB),
    ]
