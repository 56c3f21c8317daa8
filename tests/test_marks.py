"""The vram markers: decorators, and how a test's markers are checked and parsed."""

from __future__ import annotations

import warnings
from typing import Any

import pytest

import pytest_vram
from pytest_vram.backends import BACKENDS
from pytest_vram.marks import (
    METRICS,
    Budget,
    MarkerError,
    VramMarks,
    max_vram,
    read_marks,
    requires_vram,
    vram_backend,
    vram_tolerance,
)
from pytest_vram.units import parse_tolerance

GiB = 1024**3

# Under -p no:vram the markers are not registered; building them must not warn about it.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnknownMarkWarning")


def mark(name: str, *args: Any, **kwargs: Any) -> pytest.Mark:
    """``pytest.mark.<name>(*args, **kwargs).mark``, for parameter lists built at import."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        return getattr(pytest.mark, name)(*args, **kwargs).mark


def test_decorators_are_importable_from_the_package() -> None:
    assert pytest_vram.max_vram is max_vram
    assert pytest_vram.vram_tolerance is vram_tolerance
    assert pytest_vram.vram_backend is vram_backend
    assert pytest_vram.requires_vram is requires_vram


@pytest.mark.parametrize(
    ("decorator", "args", "kwargs"),
    [
        (max_vram, ("72GB",), {"metric": "reserved"}),
        (max_vram, (1024,), {}),
        (vram_tolerance, ("5%",), {}),
        (vram_backend, ("cpu",), {}),
        (requires_vram, ("80GB",), {}),
    ],
)
def test_decorator_makes_the_pytest_mark(
    decorator: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> None:
    ours = decorator(*args, **kwargs)
    assert isinstance(ours, pytest.MarkDecorator)
    assert ours.mark == getattr(pytest.mark, decorator.__name__)(*args, **kwargs).mark


def test_max_vram_default_metric_makes_the_same_mark_as_pytest_mark() -> None:
    assert max_vram("72GB").mark == pytest.mark.max_vram("72GB").mark


def test_max_vram_default_metric_reads_the_same_as_pytest_mark() -> None:
    ours = read_marks([max_vram("72GB").mark])
    pytests = read_marks([pytest.mark.max_vram("72GB").mark])
    assert ours == pytests
    assert ours.budgets == (Budget(72_000_000_000, "allocated", "72GB"),)


def test_decorator_applied_to_a_function_marks_it() -> None:
    @max_vram("1GiB", metric="reserved")
    @vram_backend("sim")
    def decorated() -> None:
        pass

    @pytest.mark.max_vram("1GiB", metric="reserved")
    @pytest.mark.vram_backend("sim")
    def plain() -> None:
        pass

    assert decorated.pytestmark == plain.pytestmark  # type: ignore[attr-defined]


def test_no_marks() -> None:
    marks = read_marks([])
    assert marks == VramMarks()
    assert not marks.any
    assert marks.budgets == ()
    assert marks.tolerance is None
    assert marks.backend is None
    assert marks.required is None


def test_other_markers_are_ignored() -> None:
    marks = read_marks(
        [pytest.mark.skipif(False, reason="x").mark, pytest.mark.parametrize("a", [1]).mark]
    )
    assert marks == VramMarks()


def test_budget_default_metric_is_allocated() -> None:
    marks = read_marks([pytest.mark.max_vram("1GB").mark])
    assert marks.any
    assert marks.budgets == (Budget(limit=1_000_000_000, metric="allocated", as_written="1GB"),)


@pytest.mark.parametrize("metric", METRICS)
def test_budget_metrics(metric: str) -> None:
    marks = read_marks([pytest.mark.max_vram("2GiB", metric=metric).mark])
    assert marks.budgets == (Budget(limit=2 * GiB, metric=metric, as_written="2GiB"),)


def test_budget_limit_may_be_an_int_or_keyword() -> None:
    marks = read_marks([pytest.mark.max_vram(limit=4096).mark])
    assert marks.budgets == (Budget(limit=4096, metric="allocated", as_written=4096),)


def test_several_max_vram_marks_all_apply() -> None:
    marks = read_marks(
        [
            pytest.mark.max_vram("1GB").mark,
            pytest.mark.max_vram("2GiB", metric="reserved").mark,
            pytest.mark.max_vram("3GB", metric="device").mark,
            pytest.mark.max_vram("500MB").mark,
        ]
    )
    assert marks.budgets == (
        Budget(1_000_000_000, "allocated", "1GB"),
        Budget(2 * GiB, "reserved", "2GiB"),
        Budget(3_000_000_000, "device", "3GB"),
        Budget(500_000_000, "allocated", "500MB"),
    )


def test_tolerance_marker() -> None:
    marks = read_marks([pytest.mark.vram_tolerance("64MiB").mark])
    assert marks.any
    assert marks.tolerance == parse_tolerance("64MiB")
    assert marks.tolerance is not None
    assert marks.tolerance.allowance(10 * GiB) == 64 * 1024**2


@pytest.mark.parametrize("name", BACKENDS)
def test_backend_marker(name: str) -> None:
    marks = read_marks([pytest.mark.vram_backend(name).mark])
    assert marks.any
    assert marks.backend == name


def test_requires_vram_marker() -> None:
    marks = read_marks([pytest.mark.requires_vram("80GB").mark])
    assert marks.any
    assert marks.required == 80_000_000_000
    assert marks.required_as_written == "80GB"


def test_closest_marker_wins_for_tolerance_backend_and_requires() -> None:
    # read_marks takes markers closest first, as Node.iter_markers yields them.
    marks = read_marks(
        [
            pytest.mark.vram_tolerance("1%").mark,
            pytest.mark.vram_backend("cpu").mark,
            pytest.mark.requires_vram("1GB").mark,
            pytest.mark.vram_tolerance("10%").mark,
            pytest.mark.vram_backend("sim").mark,
            pytest.mark.requires_vram("80GB").mark,
        ]
    )
    assert marks.tolerance is not None
    assert marks.tolerance.percent == 1.0
    assert marks.backend == "cpu"
    assert marks.required == 1_000_000_000


def test_all_markers_together() -> None:
    marks = read_marks(
        [
            max_vram("1GB").mark,
            vram_tolerance("2%").mark,
            vram_backend("sim").mark,
            requires_vram("8GiB").mark,
        ]
    )
    assert marks.budgets == (Budget(1_000_000_000, "allocated", "1GB"),)
    assert str(marks.tolerance) == "2%"
    assert marks.backend == "sim"
    assert marks.required == 8 * GiB


@pytest.mark.parametrize(
    ("mark", "marker", "bad"),
    [
        (mark("max_vram", "1GB", metric="vram"), "max_vram", "'vram'"),
        (mark("max_vram", "1GB", metric="Allocated"), "max_vram", "'Allocated'"),
        (mark("max_vram", "72GBs"), "max_vram", "'72GBs'"),
        (mark("max_vram", "-1GB"), "max_vram", "'-1GB'"),
        (mark("max_vram", None), "max_vram", "None"),
        (mark("max_vram", "1GB", budget="2GB"), "max_vram", "'budget'"),
        (mark("vram_backend", "gpu"), "vram_backend", "'gpu'"),
        (mark("vram_backend", "CUDA"), "vram_backend", "'CUDA'"),
        (mark("vram_tolerance", "5 percent"), "vram_tolerance", "'5 percent'"),
        (mark("vram_tolerance", "-5%"), "vram_tolerance", "'-5%'"),
        (mark("requires_vram", "lots"), "requires_vram", "'lots'"),
        (mark("requires_vram", "1e3"), "requires_vram", "'1e3'"),
        (mark("requires_vram", "80GB", strict=True), "requires_vram", "'strict'"),
    ],
)
def test_bad_marker_arguments(mark: pytest.Mark, marker: str, bad: str) -> None:
    with pytest.raises(MarkerError) as info:
        read_marks([mark])
    message = str(info.value)
    assert marker in message
    assert bad in message


def test_bad_metric_lists_the_metrics() -> None:
    with pytest.raises(MarkerError) as info:
        read_marks([pytest.mark.max_vram("1GB", metric="vram").mark])
    for metric in METRICS:
        assert metric in str(info.value)


def test_bad_backend_lists_the_backends() -> None:
    with pytest.raises(MarkerError) as info:
        read_marks([pytest.mark.vram_backend("gpu").mark])
    for name in BACKENDS:
        assert name in str(info.value)


@pytest.mark.parametrize(
    ("mark", "marker"),
    [
        (mark("max_vram"), "max_vram"),
        (mark("vram_tolerance"), "vram_tolerance"),
        (mark("vram_backend"), "vram_backend"),
        (mark("requires_vram"), "requires_vram"),
    ],
)
def test_missing_argument_names_the_marker(mark: pytest.Mark, marker: str) -> None:
    with pytest.raises(MarkerError, match=marker) as info:
        read_marks([mark])
    assert "missing" in str(info.value)


@pytest.mark.parametrize(
    ("mark", "marker"),
    [
        (mark("vram_backend", "cpu", "sim"), "vram_backend"),
        (mark("vram_tolerance", "5%", "10%"), "vram_tolerance"),
    ],
)
def test_extra_positional_argument_is_an_error(mark: pytest.Mark, marker: str) -> None:
    with pytest.raises(MarkerError, match=marker):
        read_marks([mark])


def test_extra_positional_argument_names_the_value() -> None:
    with pytest.raises(MarkerError) as info:
        read_marks([pytest.mark.max_vram("1GB", "reserved").mark])
    assert "max_vram" in str(info.value)
    assert "'reserved'" in str(info.value)


def test_metric_is_keyword_only() -> None:
    with pytest.raises(MarkerError, match="max_vram"):
        read_marks([pytest.mark.max_vram("1GB", "reserved").mark])


def test_an_error_in_any_budget_is_raised() -> None:
    with pytest.raises(MarkerError, match="'2XB'"):
        read_marks([pytest.mark.max_vram("1GB").mark, pytest.mark.max_vram("2XB").mark])
