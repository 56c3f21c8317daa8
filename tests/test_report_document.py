"""The terminal summary, the JUnit properties and the JSON document."""

from __future__ import annotations

import json
from typing import Any

import pytest

from pytest_vram import __version__
from pytest_vram.records import STATUS_ORDER
from pytest_vram.records import TestRecord as Record
from pytest_vram.report.document import build_document, junit_properties, terminal_lines, totals

GiB = 1024**3
MiB = 1024**2


def record(nodeid: str, peak: int, status: str = "ok", **kwargs: Any) -> Record:
    fields: dict[str, Any] = {
        "backend": "cuda",
        "device": "NVIDIA H100 80GB HBM3",
        "peak_allocated": peak,
        "status": status,
    }
    fields.update(kwargs)
    return Record(nodeid=nodeid, **fields)


def records() -> list[Record]:
    return [
        record("t.py::test_ok_small", 1 * GiB, baseline={"peak_allocated": 1 * GiB}),
        record("t.py::test_new", 3 * GiB, "new"),
        record("t.py::test_ok_big", 8 * GiB, baseline={"peak_allocated": 8 * GiB}),
        record("t.py::test_regressed", 2 * GiB, "regression", baseline={"peak_allocated": GiB}),
        record("t.py::test_improved", 1 * GiB, "improved", baseline={"peak_allocated": 2 * GiB}),
        record("t.py::test_oom", 80 * GiB, "oom"),
        record("t.py::test_over", 73 * GiB, "over-budget"),
        record("t.py::test_leak", 4 * GiB, "leak"),
    ]


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
        s for s in STATUS_ORDER if s not in ("failed", "skipped")
    ]
    assert totals([]) == {"measured": 0}


# -- JUnit -------------------------------------------------------------------------------


def test_junit_properties_names_and_integer_sizes() -> None:
    props = dict(
        junit_properties(
            record(
                "t.py::test_a",
                3 * GiB,
                "regression",
                start_allocated=1 * GiB,
                end_allocated=1 * GiB + 512,
                peak_reserved=4 * GiB,
                peak_device=5 * GiB,
                baseline={"peak_allocated": 2 * GiB},
                scenarios={"leak_check": {"growth": 4096}},
            )
        )
    )
    assert props == {
        "vram_backend": "cuda",
        "vram_device": "NVIDIA H100 80GB HBM3",
        "vram_peak_allocated": 3 * GiB,
        "vram_baseline": 2 * GiB,
        "vram_status": "regression",
        "vram_start_allocated": 1 * GiB,
        "vram_peak_increment": 2 * GiB,
        "vram_leftover": 512,
        "vram_peak_reserved": 4 * GiB,
        "vram_peak_device": 5 * GiB,
        "vram_leak_growth": 4096,
    }
    for name, value in props.items():
        assert name.startswith("vram_")
        if name not in ("vram_backend", "vram_device", "vram_status"):
            assert type(value) is int, name


def test_junit_properties_without_optional_figures() -> None:
    props = junit_properties(record("t.py::test_a", 1024, "new", backend="cpu", device="cpu"))
    names = [name for name, _ in props]
    assert names[:3] == ["vram_backend", "vram_device", "vram_peak_allocated"]
    assert "vram_status" in names
    for absent in ("vram_baseline", "vram_peak_reserved", "vram_peak_device", "vram_leak_growth"):
        assert absent not in names
    assert dict(props)["vram_status"] == "new"


def test_junit_property_names_are_unique() -> None:
    names = [name for name, _ in junit_properties(records()[3])]
    assert len(names) == len(set(names))


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
