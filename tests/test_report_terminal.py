"""The --vram-report terminal summary."""

from __future__ import annotations

import json

from report_records import record, records

from pytest_vram.report.document import build_document
from pytest_vram.report.terminal import render_terminal, terminal_lines

GiB = 1024**3
MiB = 1024**2


def row_order(lines: list[str]) -> list[str]:
    return [line.split()[0] for line in lines[1:] if line.startswith("t.py::")]


# -- terminal ----------------------------------------------------------------------------


def test_terminal_lines_worst_first_then_by_peak() -> None:
    lines = terminal_lines(records())
    assert row_order(lines) == [
        "t.py::test_oom",
        "t.py::test_over",
        "t.py::test_leak",
        "t.py::test_regressed",
        "t.py::test_new",
        "t.py::test_improved",
        "t.py::test_ok_big",
        "t.py::test_ok_small",
    ]


def test_terminal_lines_header_and_columns() -> None:
    lines = terminal_lines(
        [
            record(
                "t.py::test_regressed",
                2 * GiB,
                "regression",
                start_allocated=512 * MiB,
                end_allocated=640 * MiB,
                baseline={"peak_allocated": 1 * GiB},
            )
        ]
    )
    header = lines[0].split()
    assert header == [
        "test",
        "backend",
        "peak",
        "increment",
        "leftover",
        "baseline",
        "change",
        "status",
    ]
    row = lines[1]
    assert row.startswith("t.py::test_regressed")
    assert row.endswith("regression")
    for text in ("cuda", "2.00 GiB", "1.50 GiB", "128.00 MiB", "1.00 GiB", "+1.00 GiB (+100.0%)"):
        assert text in row
    assert lines[2] == "1 measured test: 1 regression"


def test_terminal_lines_columns_line_up() -> None:
    lines = terminal_lines(records())
    table = lines[: len(records()) + 1]
    status_column = {line.rindex(" ") for line in table}
    assert len(status_column) == 1


def test_terminal_lines_without_baseline_show_dashes() -> None:
    row = terminal_lines([record("t.py::test_new", 512, "new")])[1]
    cells = row.split()
    assert cells[-3:] == ["-", "-", "new"]


def test_terminal_lines_totals() -> None:
    lines = terminal_lines(records())
    assert lines[-1] == (
        "8 measured tests: 1 oom, 1 over-budget, 1 leak, 1 regression, 1 new, 1 improved, 2 ok"
    )


def test_terminal_lines_stale_entries() -> None:
    lines = terminal_lines([record("t.py::a", 1)], stale=["t.py::gone", "t.py::old"])
    assert lines[-3].startswith("2 baseline entries have no test any more")
    assert "--vram-prune-baselines" in lines[-3]
    assert lines[-2:] == ["  t.py::gone", "  t.py::old"]


def test_terminal_lines_render_the_document() -> None:
    # The summary of the records and that of the JSON document written from them are one text.
    document = json.loads(json.dumps(build_document(records(), {})))
    stale = ["t.py::gone"]
    assert render_terminal(document, stale) == terminal_lines(records(), stale)


def test_terminal_lines_one_stale_entry_and_zero_baseline() -> None:
    rec = record("t.py::a", 1024, "regression", baseline={"peak_allocated": 0})
    lines = terminal_lines([rec], stale=["t.py::gone"])
    # A zero baseline has no percentage.
    assert lines[1].endswith(" 0 B  +1.00 KiB  regression")
    assert lines[-2] == (
        "1 baseline entry has no test any more (remove it with --vram-prune-baselines):"
    )
    assert lines[-1] == "  t.py::gone"


def test_terminal_lines_without_tests() -> None:
    assert terminal_lines([]) == [
        "test  backend  peak  increment  leftover  baseline  change  status",
        "0 measured tests",
    ]


def test_a_test_skipped_before_it_allocated_gets_no_row_and_is_counted() -> None:
    lines = terminal_lines(
        [
            record("t.py::ran", 512),
            record("t.py::skipped_early", 0, "skipped"),
            record("t.py::skipped_late", 1024, "skipped"),
        ]
    )
    assert row_order(lines) == ["t.py::ran", "t.py::skipped_late"]
    assert lines[-1] == "3 measured tests: 1 ok, 2 skipped"
