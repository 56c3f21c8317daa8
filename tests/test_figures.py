"""The one check of a figure read back, and of a record read from a ``--vram-json`` document."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from pytest_vram.record.figures import (
    MAX_FIGURE,
    FigureError,
    check_change,
    check_entry,
    check_figure,
    check_figure_name,
    check_nodeid,
    check_rank,
    check_text,
    figure_from_text,
)
from pytest_vram.record.record import TestRecord, read_record

# A record as a --vram-json document carries it (sim backend, with the scenarios and the
# breakdown whose figures a baseline stores).
ROW: dict[str, Any] = {
    "nodeid": "test_m.py::test_model",
    "backend": "sim",
    "device": "sim",
    "peak_allocated": 38400,
    "start_allocated": 0,
    "end_allocated": 0,
    "peak_reserved": 2097152,
    "peak_device": None,
    "counters": {"num_ooms": 0},
    "budgets": [],
    "scenarios": {
        "empty_cache": {"allocated": 18944},
        "single_step": {"peak": 36864, "delta": 17920, "before": 18944, "after": 35840},
        "leak_check": {"per_step": [35840, 35840], "growth": 0, "steps": 2, "leaked": False},
    },
    "baseline": None,
    "outcome": "passed",
    "status": "new",
    "messages": [],
    "breakdown": {
        "total": 38400,
        "categories": {
            "parameters": 16896,
            "gradients": 16896,
            "optimizer": 0,
            "activations": 2048,
            "temporaries": 2560,
            "cublas_workspaces": 0,
            "other": 0,
        },
        "modules": [],
    },
    "peak_increment": 38400,
    "leftover": 0,
}


def row_with(path: tuple[str | int, ...], value: object) -> dict[str, Any]:
    row = copy.deepcopy(ROW)
    target: Any = row
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return row


# -- one figure ------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 1, 4096, MAX_FIGURE])
def test_a_figure_is_a_whole_number_of_bytes_within_64_bits(value: int) -> None:
    assert check_figure("peak_allocated", value) == value


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (-5, "peak_allocated is -5: a number of bytes is never negative"),
        (1.5, "peak_allocated must be an integer number of bytes, got 1.5"),
        (4096.0, "peak_allocated must be an integer number of bytes, got 4096.0"),
        (True, "peak_allocated must be an integer number of bytes, got True"),
        ("4096", "peak_allocated must be an integer number of bytes, got '4096'"),
        (None, "peak_allocated must be an integer number of bytes, got None"),
        (float("nan"), "peak_allocated is nan: a number of bytes is a whole number"),
        (float("inf"), "peak_allocated is inf: a number of bytes is a whole number"),
        (MAX_FIGURE + 1, "peak_allocated has 19 digits: more bytes than any device holds"),
        pytest.param(10**399, "peak_allocated has 400 digits: more bytes", id="400-digits"),
        pytest.param(-(10**399), "peak_allocated has 400 digits", id="-400-digits"),
        # More digits than Python writes out: counted, never converted.
        pytest.param(10**5000, "peak_allocated has 5001 digits", id="5001-digits"),
    ],
)
def test_a_bad_figure_says_what_is_wrong_with_the_value(value: object, message: str) -> None:
    with pytest.raises(FigureError) as info:
        check_figure("peak_allocated", value)
    assert str(info.value).startswith(message)


def test_a_change_may_be_negative_but_not_anything_else() -> None:
    assert check_change("growth", -20480) == -20480
    assert check_change("growth", 0) == 0
    with pytest.raises(FigureError, match="growth must be an integer number of bytes, got 'lots'"):
        check_change("growth", "lots")
    with pytest.raises(FigureError, match="growth has 400 digits"):
        check_change("growth", -(10**399))


@pytest.mark.parametrize(
    ("text", "expected"), [("4096", 4096), (" 0 ", 0), (str(MAX_FIGURE), MAX_FIGURE)]
)
def test_a_figure_written_as_text(text: str, expected: int) -> None:
    assert figure_from_text("vram_peak_allocated", text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("lots", "vram_peak_allocated must be an integer number of bytes, got 'lots'"),
        ("1.5", "vram_peak_allocated must be an integer number of bytes, got '1.5'"),
        ("4 KiB", "vram_peak_allocated must be an integer number of bytes, got '4 KiB'"),
        ("", "vram_peak_allocated must be an integer number of bytes, got ''"),
        ("٤٠٩٦", "vram_peak_allocated must be an integer number of bytes"),  # Arabic digits
        ("-5", "vram_peak_allocated is -5: a number of bytes is never negative"),
        pytest.param("9" * 400, "vram_peak_allocated has 400 digits: more", id="400-digits"),
        pytest.param("9" * 5000, "vram_peak_allocated has 5000 digits", id="5000-digits"),
    ],
)
def test_a_figure_written_as_text_that_is_none(text: str, message: str) -> None:
    with pytest.raises(FigureError) as info:
        figure_from_text("vram_peak_allocated", text)
    assert str(info.value).startswith(message)


def test_a_signed_figure_written_as_text() -> None:
    assert figure_from_text("vram_leak_growth", "-4096", signed=True) == -4096
    with pytest.raises(FigureError, match="has 401 digits"):
        figure_from_text("vram_leak_growth", "-1" + "0" * 400, signed=True)


# -- names, node ids, text, ranks ------------------------------------------------------------


@pytest.mark.parametrize(
    "name", ["peak_allocated", "leak_growth", "peak_parameters", "idle_rank0", "peak_device_rank7"]
)
def test_known_figure_names(name: str) -> None:
    assert check_figure_name(name) == name


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("peak", "unknown figure 'peak'; known figures are"),
        ("peak_allocated_rank01", "unknown figure 'peak_allocated_rank01'"),
        ("peak_allocated_rank1_rank2", "unknown figure"),
        (5, "a figure name must be text, got 5"),
    ],
)
def test_unknown_figure_names(name: object, message: str) -> None:
    with pytest.raises(FigureError) as info:
        check_figure_name(name)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize("value", [5, None, "", ["t.py::a"]])
def test_a_node_id_is_text(value: object) -> None:
    with pytest.raises(FigureError, match="a test node id must be text, got"):
        check_nodeid(value)


@pytest.mark.parametrize("value", [7, None, "", "  ", True])
def test_a_device_is_text(value: object) -> None:
    with pytest.raises(FigureError, match="device must be text, got"):
        check_text("device", value)
    assert check_text("device", "NVIDIA H100 80GB HBM3") == "NVIDIA H100 80GB HBM3"


@pytest.mark.parametrize("value", [-1, 1_000_000, "1", True, 1.0])
def test_a_rank_is_a_small_whole_number(value: object) -> None:
    with pytest.raises(FigureError, match="rank must be a rank from 0 to 999999, got"):
        check_rank("rank", value)
    assert check_rank("rank", 999_999) == 999_999


def test_an_entry_is_checked_figure_by_figure_and_names_the_test() -> None:
    assert check_entry("t.py::a", {"peak_allocated": 1, "idle_rank1": 0}) == (
        "t.py::a",
        {"peak_allocated": 1, "idle_rank1": 0},
    )
    with pytest.raises(FigureError) as info:
        check_entry("t.py::a", {"peak_allocated": 1, "idle": "lots"})
    assert str(info.value) == "'t.py::a': idle must be an integer number of bytes, got 'lots'"
    with pytest.raises(FigureError, match=r"the entry of 't\.py::a' must map figure names"):
        check_entry("t.py::a", [1])
    with pytest.raises(FigureError, match="a test node id must be text, got 5"):
        check_entry(5, {"peak_allocated": 1})


# -- a record read back ----------------------------------------------------------------------


def test_a_measured_record_reads_back_with_the_figures_a_baseline_stores() -> None:
    record = read_record(copy.deepcopy(ROW))
    assert record.figures() == {
        "peak_allocated": 38400,
        "peak_reserved": 2097152,
        "idle": 18944,
        "single_step_peak": 36864,
        "leak_growth": 0,
        "peak_parameters": 16896,
        "peak_gradients": 16896,
        "peak_activations": 2048,
        "peak_temporaries": 2560,
    }


@pytest.mark.parametrize(
    ("path", "value", "message"),
    [
        (("peak_allocated",), -5, "peak_allocated is -5: a number of bytes is never negative"),
        (("peak_allocated",), "4096", "peak_allocated must be an integer number of bytes"),
        (("start_allocated",), 1.5, "start_allocated must be an integer number of bytes"),
        (("peak_reserved",), True, "peak_reserved must be an integer number of bytes, got True"),
        (("peak_device",), float("nan"), "peak_device is nan"),
        (("scenarios", "leak_check", "growth"), "lots", "scenarios.leak_check.growth must be"),
        (("scenarios", "single_step", "peak"), -1, "scenarios.single_step.peak is -1"),
        (("scenarios", "empty_cache", "allocated"), None, "scenarios.empty_cache.allocated must"),
        (("scenarios", "empty_cache"), 5, "scenarios.empty_cache must be an object, got 5"),
        (("scenarios",), [], "scenarios must be an object, got []"),
        pytest.param(
            ("breakdown", "categories", "optimizer"),
            10**400,
            "breakdown.categories.optimizer has 401 digits",
            id="breakdown-401-digits",
        ),
        (("breakdown", "categories"), [1], "breakdown.categories must be an object, got [1]"),
        (("breakdown",), "all", "breakdown must be an object, got 'all'"),
        (("nodeid",), 5, "a test node id must be text, got 5"),
        (("backend",), 7, "backend must be text, got 7"),
        (("device",), 7, "device must be text, got 7"),
    ],
)
def test_a_record_read_back_names_the_bad_field_and_value(
    path: tuple[str, ...], value: object, message: str
) -> None:
    with pytest.raises(FigureError) as info:
        read_record(row_with(path, value))
    assert str(info.value).startswith(message)


def rank(number: object, **figures: object) -> dict[str, Any]:
    return {"rank": number, "status": "new", "outcome": "passed", "leftover": 0, "figures": figures}


def test_each_ranks_figures_are_checked() -> None:
    good = [rank(0, peak_allocated=100), rank(1, peak_allocated=300)]
    figures = read_record(row_with(("ranks",), good)).figures()
    assert figures == {
        "peak_allocated": 300,
        "peak_allocated_rank0": 100,
        "peak_allocated_rank1": 300,
    }

    for ranks, message in [
        ([rank(0, peak_allocated=100), rank(1, peak_allocated="lots")], "ranks[1].figures.pea"),
        ([rank("one", peak_allocated=1)], "ranks[0].rank must be a rank from 0 to 999999"),
        ([rank(0, peak=1)], "ranks[0].figures: unknown figure 'peak'"),
        ([rank(0, peak_allocated_rank1=1)], "'test_m.py::test_model': unknown figure"),
        ([5], "ranks[0] must be an object, got 5"),
        ({"0": 1}, "ranks must be a list, got {'0': 1}"),
    ]:
        with pytest.raises(FigureError) as info:
            read_record(row_with(("ranks",), ranks))
        assert str(info.value).startswith(message)


def test_data_that_is_no_record_is_not_a_figure_error() -> None:
    with pytest.raises(TypeError):
        read_record([1, 2])
    with pytest.raises(TypeError):
        read_record({"nodeid": "t.py::a"})


def test_a_leak_check_whose_memory_fell_stores_no_growth() -> None:
    # Growth is negative when the steps freed memory held before them; a figure never is.
    row = row_with(("scenarios", "leak_check", "growth"), -20480)
    assert read_record(row).figures()["leak_growth"] == 0
    made = TestRecord("t.py::a", "cpu", "cpu", scenarios={"leak_check": {"growth": -20480}})
    assert made.figures()["leak_growth"] == 0


@pytest.mark.parametrize(
    ("read", "message"),
    [
        (lambda: check_figure("max_size", -3), "max_size is -3: a count is never negative"),
        (lambda: check_figure("max_size", 1.5), "max_size must be an integer count, got 1.5"),
        (
            lambda: check_figure("scenarios.max_size.value", "12"),
            "scenarios.max_size.value must be an integer count, got '12'",
        ),
        (
            lambda: check_figure("ranks[1].figures.max_size_rank1", -1),
            "ranks[1].figures.max_size_rank1 is -1: a count is never negative",
        ),
        (
            lambda: figure_from_text("vram_max_size", "lots"),
            "vram_max_size must be an integer count, got 'lots'",
        ),
        (
            lambda: figure_from_text("vram_max_size", "9" * 400),
            f"vram_max_size has 400 digits: a count holds at most {MAX_FIGURE}",
        ),
        (
            lambda: check_figure("peak_allocated", -3),
            "peak_allocated is -3: a number of bytes is never negative",
        ),
    ],
)
def test_a_stored_largest_size_is_called_a_count(read: Any, message: str) -> None:
    with pytest.raises(FigureError) as info:
        read()
    assert str(info.value) == message
