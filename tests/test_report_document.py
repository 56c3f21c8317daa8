"""The report document: what --vram-json writes and every report renders from."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from report_records import record, records

from pytest_vram import __version__
from pytest_vram.record.record import STATUS_ORDER
from pytest_vram.record.record import TestRecord as Record
from pytest_vram.record.status import Status
from pytest_vram.report.document import (
    baseline_peak,
    build_document,
    document_tests,
    record_row,
    status_counts,
    totals,
)

GiB = 1024**3
MiB = 1024**2


def test_totals_counts_by_status() -> None:
    assert totals(records()) == {
        "measured": 8,
        "oom": 1,
        "over-budget": 1,
        "leak": 1,
        "regression": 1,
        "new": 1,
        "improved": 1,
        "ok": 2,
    }
    assert list(totals(records()))[1:] == [
        s for s in STATUS_ORDER if s not in ("failed", "ungated", "skipped")
    ]
    assert totals([]) == {"measured": 0}


# -- JSON --------------------------------------------------------------------------------


def test_build_document() -> None:
    environments = {"cuda": {"backend": "cuda", "gpu": "NVIDIA H100 80GB HBM3", "driver": "570"}}
    document = build_document(records(), environments)
    assert document["pytest_vram"] == __version__
    assert document["environments"] == environments
    assert document["totals"] == totals(records())
    assert isinstance(document["created"], str)
    assert [t["nodeid"] for t in document["tests"]][:2] == ["t.py::test_oom", "t.py::test_over"]

    by_id = {t["nodeid"]: t for t in document["tests"]}
    regressed = by_id["t.py::test_regressed"]
    assert regressed["change"] == GiB
    assert regressed["change_percent"] == pytest.approx(100.0)
    assert regressed["peak_allocated"] == 2 * GiB
    assert regressed["baseline"] == {"peak_allocated": GiB}
    improved = by_id["t.py::test_improved"]
    assert improved["change"] == -GiB
    assert improved["change_percent"] == pytest.approx(-50.0)
    new = by_id["t.py::test_new"]
    assert new["change"] is None
    assert new["change_percent"] is None


def test_build_document_figures_of_a_test() -> None:
    rec = record(
        "t.py::test_a",
        3 * GiB,
        start_allocated=GiB,
        end_allocated=GiB + 100,
        scenarios={"single_step": {"peak": 5, "delta": 1, "before": 4, "after": 4}},
    )
    (test,) = build_document([rec], {})["tests"]
    assert test["peak_increment"] == 2 * GiB
    assert test["leftover"] == 100
    assert test["scenarios"] == {"single_step": {"peak": 5, "delta": 1, "before": 4, "after": 4}}
    assert Record.from_dict(test) == rec


def test_build_document_zero_baseline_has_no_percent() -> None:
    rec = record("t.py::test_a", 1024, "regression", baseline={"peak_allocated": 0})
    (test,) = build_document([rec], {})["tests"]
    assert test["change"] == 1024
    assert test["change_percent"] is None


def test_build_document_is_json_serialisable() -> None:
    document = build_document(records(), {"cuda": {"torch": "2.13.0", "total_memory": 80 * GiB}})
    assert json.loads(json.dumps(document)) == document


def test_totals_follow_the_status_order() -> None:
    every = [record(f"t.py::{s.value}", 1, s.value) for s in reversed(Status)]
    assert list(totals(every))[1:] == [s.value for s in Status]
    assert list(totals(every))[1:] == list(STATUS_ORDER)


def test_record_row_is_a_test_of_the_document() -> None:
    rec = record("t.py::test_a", 2 * GiB, "regression", baseline={"peak_allocated": GiB})
    (test,) = build_document([rec], {})["tests"]
    assert record_row(rec) == test


def test_tests_of_skips_what_is_not_a_test() -> None:
    document = {"tests": [{"nodeid": "a"}, "junk", None, {"nodeid": "b"}]}
    assert [t["nodeid"] for t in document_tests(document)] == ["a", "b"]
    assert document_tests({}) == [] and document_tests({"tests": None}) == []


def test_baseline_peak() -> None:
    assert baseline_peak({"baseline": {"peak_allocated": 5}}) == 5
    assert baseline_peak({"baseline": {"peak_allocated": 0}}) == 0
    for test in ({}, {"baseline": None}, {"baseline": {}}, {"baseline": {"peak_allocated": True}}):
        assert baseline_peak(test) is None


def test_status_counts_from_totals_or_tests() -> None:
    document = build_document(records(), {})
    measured, counts = status_counts(document)
    assert measured == 8
    assert counts == {k: v for k, v in totals(records()).items() if k != "measured"}
    del document["totals"]
    assert status_counts(document) == (measured, counts)


def test_status_counts_rank_unknown_keys_last() -> None:
    # "regressions" is no status: it is kept as written, after every status.
    document = {"totals": {"measured": 4, "regressions": 2, "ok": 1, "oom": 1, "zero": 0}}
    assert status_counts(document) == (4, {"oom": 1, "ok": 1, "regressions": 2})
    assert status_counts({"totals": {"ok": True, "measured": "many"}}) == (0, {})


def test_entry_points_of_the_package() -> None:
    import pytest_vram.report as report
    from pytest_vram.report import junit as junit_module
    from pytest_vram.report import markdown, terminal

    assert report.build_document is build_document
    assert report.terminal_lines is terminal.terminal_lines
    assert report.junit_properties is junit_module.junit_properties
    assert report.render_markdown is markdown.render_markdown
    assert report.append_step_summary is markdown.append_step_summary
    assert report.render_html.__module__ == "pytest_vram.report.html"
    with pytest.raises(AttributeError, match="no attribute 'render_pdf'"):
        report.render_pdf  # noqa: B018


def test_the_markdown_and_html_renderers_load_on_first_use() -> None:
    code = (
        "import sys, pytest_vram.report as r\n"
        "assert 'pytest_vram.report.html' not in sys.modules\n"
        "assert 'pytest_vram.report.markdown' not in sys.modules\n"
        "r.render_html\n"
        "assert 'pytest_vram.report.html' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
