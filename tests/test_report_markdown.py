"""The Markdown job summary."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pytest_vram.report.document import status_counts
from pytest_vram.report.markdown import MAX_BYTES, append_step_summary, render_markdown

GiB = 1024**3
MiB = 1024**2
# A table row's cell separators: pipes not escaped with a backslash.
CELL_SEPARATOR = re.compile(r"(?<!\\)\|")


def _test(nodeid: str, peak: int, status: str = "ok", baseline: int | None = None, **extra: Any):
    change = peak - baseline if baseline is not None else None
    return {
        "nodeid": nodeid,
        "backend": "cuda",
        "device": "NVIDIA H100 80GB HBM3",
        "peak_allocated": peak,
        "baseline": {"peak_allocated": baseline} if baseline is not None else None,
        "status": status,
        "messages": [],
        "change": change,
        "change_percent": 100 * change / baseline if change is not None and baseline else None,
        **extra,
    }


def _document(tests: list[dict[str, Any]], **totals: int) -> dict[str, Any]:
    return {
        "pytest_vram": "0.1.0",
        "created": "2026-11-30T04:00:00+00:00",
        "environments": {
            "cuda": {
                "backend": "cuda",
                "device": "NVIDIA H100 80GB HBM3",
                "torch": "2.13.0+cu128",
                "cuda": "12.8",
                "driver": "570.124.06",
                "total_memory": 85_045_231_616,
            }
        },
        "totals": {"measured": len(tests), **totals},
        "tests": tests,
    }


def _rows(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line]
    return [[c.strip() for c in CELL_SEPARATOR.split(line)[1:-1]] for line in lines[1:]]


def test_heading_totals_environment_and_columns() -> None:
    document = _document(
        [
            _test("suites/test_a.py::test_train", 19 * GiB, "regression", 17 * GiB),
            _test("suites/test_a.py::test_new", 2 * GiB, "new"),
        ],
        new=1,
        regression=1,
        ok=0,
    )
    text = render_markdown(document)
    assert text.startswith(
        "## GPU memory (pytest-vram)\n\n**2** tests measured: 1 regression, 1 new."
    )
    assert (
        "- cuda: NVIDIA H100 80GB HBM3, torch 2.13.0+cu128, CUDA 12.8, driver 570.124.06, "
        "79.20 GiB total" in text
    )
    assert "| Test | Backend | Peak | Baseline | Change | Status |" in text
    assert _rows(text) == [
        [
            "`suites/test_a.py::test_train`",
            "cuda",
            "19.00 GiB",
            "17.00 GiB",
            "+2.00 GiB (+11.8%)",
            "**regression**",
        ],
        ["`suites/test_a.py::test_new`", "cuda", "2.00 GiB", "—", "—", "new"],
    ]


def test_environment_without_device_or_with_odd_values() -> None:
    document = _document([_test("t::a", 1)])
    document["environments"] = {
        "sim": {"backend": "sim", "torch": "2.13.0+cpu"},
        "cpu": {"backend": "cpu", "device": "cpu", "driver": "", "total_memory": True},
        "junk": "not an environment",
    }
    text = render_markdown(document)
    assert "- sim: sim, torch 2.13.0+cpu\n- cpu: cpu\n\n| Test |" in text


def test_a_total_that_is_no_status_comes_last() -> None:
    document = _document([_test("t::a", 1)], ok=1, regressions=2)
    assert "**1** test measured: 1 ok, 2 regressions." in render_markdown(document)


def test_totals_worst_first_and_counted_when_missing() -> None:
    tests = [_test("t::a", 1, "ok"), _test("t::b", 1, "oom"), _test("t::c", 1, "ok")]
    document = _document(tests)
    del document["totals"]
    assert "**3** tests measured: 1 oom, 2 ok." in render_markdown(document)
    assert status_counts({"totals": {"ok": 2, "leak": 1, "measured": 3}}) == (
        3,
        {"leak": 1, "ok": 2},
    )


def test_failures_first_then_largest_peaks() -> None:
    tests = [
        _test("t::small_ok", 1 * MiB),
        _test("t::big_ok", 9 * GiB, baseline=9 * GiB),
        _test("t::regression", 2 * MiB, "regression", 1 * MiB),
        _test("t::oom", 1 * MiB, "oom"),
        _test("t::mid_new", 3 * GiB, "new"),
        _test("t::improved", 5 * GiB, "improved", 6 * GiB),
    ]
    names = [row[0] for row in _rows(render_markdown(_document(tests)))]
    assert names == [
        "`t::oom`",
        "`t::regression`",
        "`t::big_ok`",
        "`t::improved`",
        "`t::mid_new`",
        "`t::small_ok`",
    ]


def test_limit_and_left_out_line() -> None:
    tests = [_test(f"t::test_{i:03d}", (i + 1) * MiB) for i in range(60)]
    text = render_markdown(_document(tests), limit=10)
    rows = _rows(text)
    assert len(rows) == 10
    assert rows[0][0] == "`t::test_059`"  # the largest peak
    assert "_50 more tests not shown; the JSON and HTML reports list every test._" in text


def test_every_failure_is_listed_even_past_the_limit() -> None:
    tests = [_test(f"t::fail_{i}", MiB, "regression", MiB // 2) for i in range(5)]
    tests += [_test(f"t::ok_{i}", GiB) for i in range(5)]
    rows = _rows(render_markdown(_document(tests), limit=3))
    assert [row[-1] for row in rows] == ["**regression**"] * 5


def test_cells_are_escaped() -> None:
    nodeid = "t.py::test_x[a|b-`tick`-<script>alert(1)</script>-&amp;]"
    text = render_markdown(_document([_test(nodeid, MiB)]))
    (row,) = _rows(text)
    assert len(row) == 6  # the pipe in the node id did not open a new cell
    # A code span fenced with more backticks than any run inside keeps the text literal.
    assert row[0] == "``t.py::test_x[a\\|b-`tick`-<script>alert(1)</script>-&amp;]``"


def test_backend_text_cannot_inject_markup() -> None:
    test = _test("t::x", MiB)
    test["backend"] = "<img src=x onerror=alert(1)>*bold*|"
    (row,) = _rows(render_markdown(_document([test])))
    assert row[1] == "&lt;img src=x onerror=alert(1)>\\*bold\\*\\|"


def test_failure_messages_in_details() -> None:
    test = _test("t::x", 2 * MiB, "regression", MiB)
    test["messages"] = ["peak 2.00 MiB exceeds ```baseline``` 1.00 MiB"]
    text = render_markdown(_document([test]))
    assert "<details><summary>Failure messages</summary>" in text
    # The fence is longer than the backtick run inside the message.
    assert "````text\nt::x: peak 2.00 MiB exceeds ```baseline``` 1.00 MiB\n````" in text


def test_capped_under_half_a_mebibyte() -> None:
    long_id = "suites/test_models.py::test_forward[" + "x" * 400 + "-{}]"
    tests = [_test(long_id.format(i), MiB, "regression", MiB // 2) for i in range(3000)]
    for test in tests:
        test["messages"] = ["m" * 5000]
    text = render_markdown(_document(tests), limit=10**6)
    size = len(text.encode())
    assert size <= MAX_BYTES
    assert size > MAX_BYTES // 2  # the cap cuts, it does not drop the table
    assert "(the summary is capped at 512.00 KiB)" in text
    assert text.rstrip().endswith("the JSON and HTML reports list every test._")
    # The cut falls between rows.
    assert all(len(row) == 6 for row in _rows(text))


def test_custom_cap() -> None:
    tests = [_test(f"t::test_{i}", MiB) for i in range(100)]
    text = render_markdown(_document(tests), limit=100, max_bytes=4096)
    assert len(text.encode()) <= 4096
    assert "more tests not shown" in text


def test_empty_document() -> None:
    text = render_markdown({"tests": []})
    assert "**0** tests measured." in text
    assert "No test was measured." in text
    assert "|" not in text


def test_append_step_summary_appends(tmp_path: Path) -> None:
    path = tmp_path / "summary.md"
    append_step_summary("first", str(path))
    assert path.read_text() == "first\n"
    path.write_text(path.read_text() + "from another step")
    append_step_summary("## table\n", path)
    assert path.read_text() == "first\nfrom another step\n## table\n"


def test_append_step_summary_respects_the_limit(tmp_path: Path) -> None:
    path = tmp_path / "summary.md"
    path.write_text("x" * (1024 * 1024 - 1000))
    append_step_summary("y" * 5000, path)
    tail = path.read_text()[1024 * 1024 - 1000 :]
    assert "yyy" not in tail
    assert "near its 1 MiB limit" in tail
