"""The text every report shares: sizes, changes, plurals, tables and environments."""

from __future__ import annotations

import pytest

from pytest_vram.report.text import (
    ENVIRONMENT_FIELDS,
    as_int,
    change_text,
    counts_text,
    environment_line,
    percent_text,
    plural,
    plural_noun,
    size_text,
    table,
)

GiB = 1024**3
MiB = 1024**2


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0, 0), (5, 5), (-3, -3), (True, None), (False, None), (1.0, None), ("5", None), (None, None)],
)
def test_as_int_takes_ints_only(value: object, expected: int | None) -> None:
    assert as_int(value) == expected
    assert type(as_int(value)) is (int if expected is not None else type(None))


def test_size_text() -> None:
    assert size_text(3 * GiB // 2) == "1.50 GiB"
    assert size_text(512) == "512 B"
    assert size_text(0) == "0 B"
    assert size_text(None) == "-"
    assert size_text(True, "—") == "—"
    assert size_text("1GiB", "") == ""


def test_percent_text_is_signed_with_one_decimal() -> None:
    assert percent_text(11.764) == "+11.8%"
    assert percent_text(-50) == "-50.0%"
    assert percent_text(0.0) == "+0.0%"
    assert percent_text(-0.04) == "-0.0%"


def test_change_text() -> None:
    assert change_text(2 * GiB, 11.76) == "+2.00 GiB (+11.8%)"
    assert change_text(-512 * MiB, -12.5) == "-512.00 MiB (-12.5%)"
    assert change_text(0, 0.0) == "+0 B (+0.0%)"
    assert change_text(0, 0) == "+0 B (+0.0%)"
    # A zero baseline has no percentage: only the bytes.
    assert change_text(1024, None) == "+1.00 KiB"
    assert change_text(1024, True) == "+1.00 KiB"
    assert change_text(None, None) == "-"
    assert change_text(None, 5.0, "—") == "—"
    assert change_text(False, 5.0, "—") == "—"


def test_plurals() -> None:
    assert plural(1, "test") == "1 test"
    assert plural(2, "test") == "2 tests"
    assert plural(0, "test") == "0 tests"
    assert plural(1, "measured test") == "1 measured test"
    assert plural(3, "baseline entry", "baseline entries") == "3 baseline entries"
    assert plural(1, "baseline entry", "baseline entries") == "1 baseline entry"
    assert plural_noun(1, "test") == "test"
    assert plural_noun(2, "test") == "tests"


def test_counts_text() -> None:
    assert counts_text({"regression": 1, "ok": 2}) == "1 regression, 2 ok"
    assert counts_text({}) == ""
    assert counts_text({"a*b": 1}, label=lambda key: key.replace("*", r"\*")) == r"1 a\*b"


def test_table_aligns_columns() -> None:
    lines = table(
        ("test", "peak", "status"),
        [("t::a", "1.00 GiB", "ok"), ("t::longer", "512 B", "regression")],
        right={1},
    )
    assert lines == [
        "test           peak  status",
        "t::a       1.00 GiB  ok",
        "t::longer     512 B  regression",
    ]


def test_table_strips_trailing_space_and_handles_no_rows() -> None:
    assert table(("a", "b"), [("x", "")]) == ["a  b", "x"]
    assert table(("name", "size"), [], right={1}) == ["name  size"]


def test_table_rejects_ragged_rows() -> None:
    with pytest.raises(ValueError):
        table(("a", "b"), [("only one",)])


def test_environment_line() -> None:
    cuda = {
        "backend": "cuda",
        "device": "NVIDIA H100 80GB HBM3",
        "torch": "2.13.0+cu128",
        "cuda": "12.8",
        "driver": "570.124.06",
        "total_memory": 85_045_231_616,
        "cpu_counter": "allocator",
    }
    assert environment_line(cuda) == (
        "NVIDIA H100 80GB HBM3, torch 2.13.0+cu128, CUDA 12.8, driver 570.124.06, 79.20 GiB total"
    )
    assert environment_line({"device": "sim", "torch": "2.13.0+cpu"}) == "sim, torch 2.13.0+cpu"


def test_environment_line_leaves_out_what_is_not_known() -> None:
    assert environment_line({"torch": "2.13.0"}, device="cpu") == "cpu, torch 2.13.0"
    assert environment_line({"torch": "2.13.0"}) == "torch 2.13.0"
    assert environment_line({"device": "sim", "cuda": None, "driver": ""}) == "sim"
    # A bool is no size.
    assert environment_line({"device": "e", "total_memory": True}) == "e"
    assert environment_line({}) == ""


def test_environment_fields_are_the_facts_after_the_device() -> None:
    assert [key for key, _ in ENVIRONMENT_FIELDS] == ["torch", "cuda", "driver"]
