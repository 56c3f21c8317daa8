"""Sizes and tolerances: the forms users type, and how messages print them."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_vram.units import (
    ACCEPTED_SIZE_FORMS,
    SizeError,
    Tolerance,
    describe_size,
    format_delta,
    format_size,
    is_si,
    parse_size,
    parse_tolerance,
)

KiB = 1024
MiB = 1024**2
GiB = 1024**3


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("72GB", 72_000_000_000),
        ("72GiB", 77_309_411_328),
        ("72gb", 72_000_000_000),
        ("72gib", 77_309_411_328),
        ("72 GB", 72_000_000_000),
        ("72 GiB", 77_309_411_328),
        ("1.5GiB", 1_610_612_736),
        ("1.5 GiB", 1_610_612_736),
        ("512", 512),
        (512, 512),
        (0, 0),
        ("0", 0),
        ("0.5KiB", 512),
        ("1 kB", 1000),
        ("1KB", 1000),
        ("1kb", 1000),
        ("3MB", 3_000_000),
        ("3MiB", 3 * MiB),
        ("2TB", 2_000_000_000_000),
        ("2TiB", 2 * 1024**4),
        ("64B", 64),
        ("64 b", 64),
    ],
)
def test_parse_size_accepted_forms(value: object, expected: int) -> None:
    assert parse_size(value) == expected


def test_parse_size_returns_an_int() -> None:
    assert type(parse_size("1.5GiB")) is int
    assert type(parse_size("72GB")) is int


@pytest.mark.parametrize(
    "value",
    [
        "72GBs",
        "-1GB",
        "GB",
        "1e3",
        None,
        True,
        False,
        1.5,
        "",
        "1  GB",
        "1,5GB",
        "1.5.2GB",
        "72 G B",
        "1PB",
        [72],
    ],
)
def test_parse_size_rejects_with_value_and_accepted_forms(value: object) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(value)
    message = str(info.value)
    assert repr(value) in message
    assert ACCEPTED_SIZE_FORMS in message


def test_parse_size_rejects_negative_int_with_accepted_forms() -> None:
    with pytest.raises(SizeError) as info:
        parse_size(-1)
    assert "-1" in str(info.value)
    assert ACCEPTED_SIZE_FORMS in str(info.value)


def test_parse_size_negative_int_is_an_error_naming_the_value() -> None:
    with pytest.raises(SizeError, match="-1"):
        parse_size(-1)


def test_size_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        parse_size("lots")


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, "0 B"),
        (1, "1 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (MiB, "1.00 MiB"),
        (3 * GiB // 2, "1.50 GiB"),
        (77_309_411_328, "72.00 GiB"),
        (72_000_000_000, "67.06 GiB"),
        (2 * 1024**4, "2.00 TiB"),
        (-512, "-512 B"),
        (-(3 * GiB // 2), "-1.50 GiB"),
        (-1024, "-1.00 KiB"),
    ],
)
def test_format_size(nbytes: int, expected: str) -> None:
    assert format_size(nbytes) == expected


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        (0, "+0 B"),
        (512, "+512 B"),
        (-512, "-512 B"),
        (3 * GiB // 2, "+1.50 GiB"),
        (-(3 * GiB // 2), "-1.50 GiB"),
    ],
)
def test_format_delta(nbytes: int, expected: str) -> None:
    assert format_delta(nbytes) == expected


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("72GB", "67.06 GiB (72GB)"),
        ("72 GB", "67.06 GiB (72 GB)"),
        ("72gb", "67.06 GiB (72gb)"),
        ("1 kB", "1000 B (1 kB)"),
        ("72GiB", "72.00 GiB"),
        ("1.5GiB", "1.50 GiB"),
        (512, "512 B"),
        ("512", "512 B"),
        (3 * GiB // 2, "1.50 GiB"),
    ],
)
def test_describe_size_shows_si_values_as_typed(value: object, expected: str) -> None:
    assert describe_size(value) == expected


def test_describe_size_rejects_bad_sizes() -> None:
    with pytest.raises(SizeError, match="72GBs"):
        describe_size("72GBs")


@pytest.mark.parametrize(
    ("value", "percent"),
    [("5%", 5.0), ("0.5%", 0.5), ("5 %", 5.0), ("100%", 100.0), ("0%", 0.0)],
)
def test_parse_tolerance_percent(value: str, percent: float) -> None:
    tolerance = parse_tolerance(value)
    assert tolerance.percent == percent
    assert tolerance.nbytes is None


@pytest.mark.parametrize(
    ("value", "nbytes"),
    [("64MiB", 64 * MiB), ("1GB", 1_000_000_000), ("0B", 0), (0, 0), (4096, 4096), ("512", 512)],
)
def test_parse_tolerance_size(value: object, nbytes: int) -> None:
    tolerance = parse_tolerance(value)
    assert tolerance.nbytes == nbytes
    assert tolerance.percent is None


def test_parse_tolerance_passes_a_tolerance_through() -> None:
    tolerance = Tolerance(percent=3.0)
    assert parse_tolerance(tolerance) is tolerance


@pytest.mark.parametrize(
    "value", ["5%%", "-5%", "%", "five percent", "72GBs", "-1GB", None, True, 1.5, ""]
)
def test_parse_tolerance_rejects_bad_values(value: object) -> None:
    with pytest.raises(SizeError) as info:
        parse_tolerance(value)
    message = str(info.value)
    assert "tolerance" in message
    assert repr(value) in message
    assert "%" in message
    assert ACCEPTED_SIZE_FORMS in message


def test_tolerance_text_is_what_was_typed() -> None:
    assert str(parse_tolerance("5%")) == "5%"
    assert str(parse_tolerance("64MiB")) == "64MiB"
    assert str(parse_tolerance(2048)) == "2.00 KiB"


def test_tolerance_text_without_typed_text() -> None:
    assert str(Tolerance(percent=2.5)) == "2.5%"
    assert str(Tolerance(nbytes=MiB)) == "1.00 MiB"


@pytest.mark.parametrize(
    ("tolerance", "reference", "allowance"),
    [
        ("5%", 1000, 50),
        ("5%", 0, 0),
        ("10%", 1_000_000_000, 100_000_000),
        ("0.5%", 2000, 10),
        ("0%", 10**9, 0),
        ("64MiB", 0, 64 * MiB),
        ("64MiB", 10 * GiB, 64 * MiB),
        ("0B", 10**9, 0),
        (0, 10**9, 0),
    ],
)
def test_tolerance_allowance(tolerance: str | int, reference: int, allowance: int) -> None:
    assert parse_tolerance(tolerance).allowance(reference) == allowance


def test_tolerance_allowance_is_whole_bytes() -> None:
    allowance = parse_tolerance("5%").allowance(1001)
    assert type(allowance) is int
    assert allowance == 50


# -- whole bytes, ASCII only ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "nbytes"),
    [("0.5B", "0.5"), ("1.0001KB", "1000.1"), ("0.3MiB", "314572.8"), ("1.5", "1.5")],
)
def test_parse_size_rejects_a_fraction_of_a_byte(value: str, nbytes: str) -> None:
    # "0.5B" used to become a budget of 0 bytes, which every test exceeds.
    with pytest.raises(SizeError) as info:
        parse_size(value)
    message = str(info.value)
    assert repr(value) in message
    assert f"that is {nbytes} bytes, not a whole number of bytes" in message
    assert ACCEPTED_SIZE_FORMS in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [("0.5KiB", 512), ("1.0B", 1), ("1.000KB", 1000), ("0.001KB", 1), ("1.25GiB", 5 * GiB // 4)],
)
def test_parse_size_accepts_a_fraction_that_comes_to_whole_bytes(value: str, expected: int) -> None:
    assert parse_size(value) == expected


def test_parse_size_is_exact_however_long_the_fraction() -> None:
    # A Decimal multiplication would round this to 2 TiB in its default 28-digit precision.
    with pytest.raises(SizeError, match="not a whole number of bytes"):
        parse_size("2.00000000000000000000000000000001TiB")
    assert parse_size("1" * 40 + "B") == int("1" * 40)


def test_parse_size_refuses_more_digits_than_python_converts_with_a_size_error() -> None:
    value = "1." + "5" * 5000 + "B"
    with pytest.raises(SizeError, match="too many digits") as info:
        parse_size(value)
    assert ACCEPTED_SIZE_FORMS in str(info.value)


@pytest.mark.parametrize(
    "value",
    [
        "７２GB",  # full-width digits
        "72ＧＢ",  # full-width letters
        "٧٢GB",  # Arabic-Indic digits
        "७२GB",  # Devanagari digits
        "72GB\u3000",  # an ideographic space, which str.strip() would remove
        "\u00a072GB",  # a no-break space
        "72\u00a0GB",
        "1.5GİB",  # a dotted capital I, which lower() turns into two characters
        "７２",
    ],
)
def test_parse_size_rejects_non_ascii_characters(value: str) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(value)
    assert repr(value) in str(info.value)
    assert ACCEPTED_SIZE_FORMS in str(info.value)


@pytest.mark.parametrize("value", [True, False, -1, -(2**70)])
def test_parse_size_rejects_bools_and_negative_ints(value: int) -> None:
    with pytest.raises(SizeError) as info:
        parse_size(value)
    assert repr(value) in str(info.value)
    assert ACCEPTED_SIZE_FORMS in str(info.value)


@pytest.mark.parametrize(
    "value",
    ["５%", "５0%", "0.５%", "5%\u3000", "６４MiB", "0.5B", "1.0001KB", "-5%", "-64MiB", -1, True],
)
def test_parse_tolerance_rejects_non_ascii_negative_and_fractional_bytes(value: object) -> None:
    with pytest.raises(SizeError) as info:
        parse_tolerance(value)
    message = str(info.value)
    assert f"invalid tolerance {value!r}" in message
    assert ACCEPTED_SIZE_FORMS in message


def test_parse_tolerance_says_why_a_size_is_refused() -> None:
    with pytest.raises(SizeError, match=r"that is 0\.5 bytes, not a whole number of bytes"):
        parse_tolerance("0.5B")
    with pytest.raises(SizeError, match="sizes cannot be negative"):
        parse_tolerance(-1)


def test_a_fractional_percentage_is_still_a_tolerance() -> None:
    assert parse_tolerance("0.5%").percent == 0.5
    assert parse_tolerance("0.5KiB").nbytes == 512


def test_is_si_is_false_for_non_ascii_digits() -> None:
    assert is_si("72GB")
    assert not is_si("７２GB")


# -- numbers too large for a float ---------------------------------------------------------------

TiB = 1024**4


@pytest.mark.parametrize(
    ("nbytes", "expected"),
    [
        pytest.param(10**300 * TiB, "1" + "0" * 300 + ".00 TiB", id="10**300-TiB"),
        pytest.param(10**400 * TiB + TiB // 4, "1" + "0" * 400 + ".25 TiB", id="10**400-TiB"),
        pytest.param(-(10**400) * TiB, "-1" + "0" * 400 + ".00 TiB", id="-10**400-TiB"),
    ],
)
def test_format_size_is_exact_past_what_a_float_holds(nbytes: int, expected: str) -> None:
    assert format_size(nbytes) == expected


def test_format_delta_and_describe_size_of_a_huge_number() -> None:
    assert format_delta(10**400 * TiB) == "+1" + "0" * 400 + ".00 TiB"
    assert describe_size("1" + "0" * 400 + "TiB") == "1" + "0" * 400 + ".00 TiB"


def test_tolerance_allowance_of_a_huge_reference() -> None:
    assert parse_tolerance("5%").allowance(10**400) == 5 * 10**398
    assert parse_tolerance("64MiB").allowance(10**400) == 64 * MiB


def test_a_baseline_figure_of_400_digits_is_an_error_naming_file_line_and_value(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_a="import torch\ndef test_a(vram):\n    x = torch.ones(1024)\n")
    baseline = pytester.path / "baselines" / "cpu.yaml"
    baseline.parent.mkdir()
    text = "device: cpu\ntests:\n  test_a.py::test_a:\n    peak_allocated: " + "9" * 400 + "\n"
    baseline.write_text(text)

    for args in ([], ["--vram-update-baselines"]):
        result = pytester.runpytest("--vram-backend=cpu", *args)
        output = result.stdout.str() + result.stderr.str()
        assert result.ret == pytest.ExitCode.USAGE_ERROR, output
        result.stderr.fnmatch_lines(
            [
                f"*{Path('baselines', 'cpu.yaml')}:4: *'test_a.py::test_a': peak_allocated has "
                "400 digits: more bytes than any device holds*"
            ]
        )
        assert "Traceback" not in output
        assert "OverflowError" not in output
        assert baseline.read_text() == text
