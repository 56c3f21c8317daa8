"""The figures a test stores, and the one check of a figure read back.

A baseline entry maps figure names to bytes (and ``max_size`` to a count: the largest size of
a step that fits). The names are the measured figures below, the
category totals at the peak (``peak_parameters`` ...) and, for a multi-rank test, each rank's own
copy of either (``peak_allocated_rank1``). Whatever reads figures from outside the process (a
baseline file, a ``--vram-json`` shard, a JUnit property) checks them here, so a value that one
reader would refuse is never written by another.

This module is the one place that knows an entry's schema: which figures a record stores
(:func:`stored_figures`, :func:`rank_figures`), how a rank's copy and a category total are named,
which figures are counts rather than bytes, and the checks of each when read back.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

__all__ = [
    "CATEGORIES",
    "CATEGORY_FIGURES",
    "CATEGORY_LABELS",
    "COMPARED_FIGURES",
    "COUNT_FIGURES",
    "LARGER_IS_BETTER",
    "MAX_FIGURE",
    "MAX_RANK",
    "MEASURED_FIGURES",
    "RANK_SUFFIX",
    "SCENARIO_FIGURES",
    "FigureError",
    "category_figures",
    "category_label",
    "check_breakdown",
    "check_categories",
    "check_change",
    "check_entry",
    "check_figure",
    "check_figure_name",
    "check_mapping",
    "check_nodeid",
    "check_rank",
    "check_rank_entries",
    "check_scenarios",
    "check_text",
    "entry_categories",
    "entry_for_rank",
    "figure_from_text",
    "figure_unit",
    "is_known_figure",
    "measured_name",
    "rank_figure_name",
    "rank_figures",
    "stored_figures",
]

#: The largest number of bytes a figure may hold: a signed 64-bit integer, as PyTorch and
#: NVML count bytes. A larger value is a corrupt file, not a measurement.
MAX_FIGURE = 2**63 - 1
_MAX_DIGITS = len(str(MAX_FIGURE))

#: The largest rank whose copy of a figure has a name (``peak_allocated_rank999999``).
MAX_RANK = 999_999

#: Figures a measurement makes.
MEASURED_FIGURES = (
    "peak_allocated",
    "peak_reserved",
    "peak_device",
    "idle",
    "single_step_peak",
    "leak_growth",
    # Not bytes: the largest size of a step that fits a capacity (vram.max_size).
    "max_size",
)
#: Figures that count something other than bytes.
COUNT_FIGURES = frozenset({"max_size"})
#: Figures where a lower value is the regression.
LARGER_IS_BETTER = frozenset({"max_size"})
#: The figures a regression is judged on, with the words messages use for them.
COMPARED_FIGURES = {
    "peak_allocated": "peak allocated",
    "single_step_peak": "single-step peak",
    "idle": "idle allocated",
    "leak_growth": "leak-check growth",
    "max_size": "largest size that fits",
}
#: Each vram scenario whose result an entry stores: the figure's name, and the result's field
#: that holds it.
SCENARIO_FIGURES = {
    "empty_cache": ("idle", "allocated"),
    "single_step": ("single_step_peak", "peak"),
    "leak_check": ("leak_growth", "growth"),
    "max_size": ("max_size", "value"),
}
# Measured as a change, which is negative when memory fell, and stored as at least 0.
_CHANGES = frozenset({"leak_growth"})

#: The categories of a peak's breakdown (see :mod:`pytest_vram.attribution.breakdown`).
#: ``cublas_workspaces``, the workspaces cuBLAS keeps for matrix multiplies (one per thread
#: that ran one), was ``other`` in baselines stored before it had its own category.
CATEGORIES = (
    "parameters",
    "gradients",
    "optimizer",
    "activations",
    "temporaries",
    "cublas_workspaces",
    "other",
)
#: How messages and reports name a category whose key is not its name.
CATEGORY_LABELS = {"cublas_workspaces": "cuBLAS workspaces"}
# An entry keeps the category totals at the peak as ``peak_<category>``.
_CATEGORY_PREFIX = "peak_"
#: Category totals at the peak.
CATEGORY_FIGURES = tuple(f"{_CATEGORY_PREFIX}{name}" for name in CATEGORIES)
_KNOWN = frozenset(MEASURED_FIGURES + CATEGORY_FIGURES)

#: What names one rank's copy of a figure: ``peak_allocated_rank1``.
RANK_SUFFIX = "_rank"
_RANK_COPY = re.compile(rf"(.+){RANK_SUFFIX}(0|[1-9][0-9]{{0,5}})")
# A whole number as text: ASCII digits only, as a report writes it.
_INTEGER_TEXT = re.compile(r"-?[0-9]+")


class FigureError(ValueError):
    """A figure, figure name, node id or other field of a record that is not what pytest-vram
    stores.

    The message names the field and says what is wrong with its value; the caller adds where
    it was read (the file, and the line or entry).
    """


def is_known_figure(name: str) -> bool:
    """Whether ``name`` is a figure pytest-vram stores."""
    if name in _KNOWN:
        return True
    match = _RANK_COPY.fullmatch(name)
    return match is not None and match.group(1) in _KNOWN


def measured_name(name: str) -> str:
    """The figure a rank's copy copies (``peak_allocated`` for ``peak_allocated_rank1``);
    any other name as it is."""
    match = _RANK_COPY.fullmatch(name)
    return match.group(1) if match else name


def figure_unit(name: str) -> str:
    """``count`` for a figure that counts sizes (``max_size`` and its rank copies), else
    ``bytes``."""
    match = _RANK_COPY.fullmatch(name)
    return "count" if (match.group(1) if match else name) in COUNT_FIGURES else "bytes"


def rank_figure_name(name: str, rank: int) -> str:
    """The name of one rank's copy of a figure: ``peak_allocated_rank1``."""
    return f"{name}{RANK_SUFFIX}{rank}"


# -- the figures a record stores -------------------------------------------------------------


def stored_figures(
    peak_allocated: int,
    peak_reserved: int | None,
    peak_device: int | None,
    scenarios: Mapping[str, Mapping[str, Any]],
    breakdown: Mapping[str, Any] | None,
) -> dict[str, int]:
    """The figures an entry stores for one process's measurement, by name."""
    figures = {"peak_allocated": peak_allocated}
    if peak_reserved is not None:
        figures["peak_reserved"] = peak_reserved
    if peak_device is not None:
        figures["peak_device"] = peak_device
    if scenarios:  # most tests run none
        for scenario, (name, key) in SCENARIO_FIGURES.items():
            if scenario in scenarios:
                value = scenarios[scenario][key]
                # Memory that fell over the steps grew by nothing: a figure is never negative.
                figures[name] = max(0, value) if name in _CHANGES else value
    if breakdown:
        figures.update(category_figures(breakdown))
    return figures


def category_label(name: str) -> str:
    """A category as messages name it: ``cuBLAS workspaces`` for ``cublas_workspaces``."""
    return CATEGORY_LABELS.get(name, name)


def category_figures(breakdown: Mapping[str, Any] | None) -> dict[str, int]:
    """The figures of a breakdown: ``peak_parameters`` and so on, for the categories that held
    anything (an entry without one holds none of it), and ``peak_other: 0`` where none did, so
    that the entry still says its categories were taken."""
    if not breakdown:
        return {}
    categories = breakdown.get("categories") or {}
    figures = {
        f"{_CATEGORY_PREFIX}{name}": int(categories[name])
        for name in CATEGORIES
        if categories.get(name)
    }
    return figures or {f"{_CATEGORY_PREFIX}other": 0}


def entry_categories(entry: Mapping[str, Any] | None) -> dict[str, int] | None:
    """The category totals an entry stores (every category; one it does not name held
    nothing), None for an entry without them."""
    if not entry or not any(name in entry for name in CATEGORY_FIGURES):
        return None
    return {name: int(entry.get(f"{_CATEGORY_PREFIX}{name}", 0)) for name in CATEGORIES}


def rank_figures(ranks: list[dict[str, Any]]) -> dict[str, int]:
    """A multi-rank test's figures: the worst of each over the ranks (the most memory; the
    smallest ``max_size``, which every rank must fit), and each rank's own copy."""
    figures: dict[str, int] = {}
    for entry in ranks:
        for name, value in entry["figures"].items():
            worst = min if name in LARGER_IS_BETTER else max
            figures[name] = worst(figures.get(name, value), value)
    for entry in ranks:
        for name, value in entry["figures"].items():
            figures[rank_figure_name(name, entry["rank"])] = value
    return figures


def entry_for_rank(entry: Mapping[str, int] | None, rank: int) -> dict[str, int] | None:
    """The figures of an entry that one rank is compared with: its own where the entry has
    them."""
    if entry is None:
        return None
    suffix = rank_figure_name("", rank)
    return {
        name: entry.get(name + suffix, value)
        for name, value in entry.items()
        if RANK_SUFFIX not in name
    }


# -- checks of figures read back -------------------------------------------------------------


def check_figure_name(name: object) -> str:
    if not isinstance(name, str):
        raise FigureError(f"a figure name must be text, got {_shown(name)}")
    if not is_known_figure(name):
        raise FigureError(
            f"unknown figure {_shown(name)}; known figures are {', '.join(sorted(_KNOWN))} "
            "(and their per-rank copies, such as peak_allocated_rank1)"
        )
    return name


def check_figure(name: str, value: object) -> int:
    """``value`` as a number of bytes (a count for ``max_size``), or FigureError saying why
    it is not one."""
    value = _integer(name, value)
    if value < 0:
        raise FigureError(f"{name} is {value}: {_noun(name)} is never negative")
    return value


def check_change(name: str, value: object) -> int:
    """``value`` as a change in bytes, which may be negative (memory that fell over a leak
    check), or FigureError saying why it is not one."""
    return _integer(name, value)


def figure_from_text(name: str, text: str, *, signed: bool = False) -> int:
    """A figure written as text (a JUnit property) as a number of bytes; with ``signed``, as a
    change in bytes (:func:`check_change`).

    The digits are counted before they are converted: Python refuses to convert more than a
    few thousand, and a number that long is refused here anyway.
    """
    stripped = text.strip()
    if not _INTEGER_TEXT.fullmatch(stripped):
        raise FigureError(f"{name} must be an integer {_noun(name)[2:]}, got {_shown(text)}")
    digits = len(stripped.lstrip("-"))
    if digits > _MAX_DIGITS:
        raise _too_long(name, digits)
    return (check_change if signed else check_figure)(name, int(stripped))


def check_rank(name: str, value: object) -> int:
    """``value`` as a rank number, the suffix of a rank's copy of a figure."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_RANK:
        raise FigureError(f"{name} must be a rank from 0 to {MAX_RANK}, got {_shown(value)}")
    return value


def check_text(name: str, value: object) -> str:
    """``value`` as the text of a field such as a backend or a device class."""
    if not isinstance(value, str) or not value.strip():
        raise FigureError(f"{name} must be text, got {_shown(value)}")
    return value


def check_nodeid(value: object) -> str:
    if not isinstance(value, str) or not value:
        raise FigureError(f"a test node id must be text, got {_shown(value)}")
    return value


def check_entry(nodeid: object, figures: object) -> tuple[str, dict[str, int]]:
    """A baseline entry read back: its node id and figures, each checked."""
    nodeid = check_nodeid(nodeid)
    if not isinstance(figures, dict):
        raise FigureError(f"the entry of {nodeid!r} must map figure names to bytes")
    checked: dict[str, int] = {}
    for name, value in figures.items():
        try:
            checked[check_figure_name(name)] = check_figure(name, value)
        except FigureError as exc:
            raise FigureError(f"{nodeid!r}: {exc}") from None
    return nodeid, checked


def check_mapping(name: str, value: object) -> dict[str, Any]:
    """``value`` as an object (a dict) read back, or FigureError naming the field."""
    if not isinstance(value, dict):
        raise FigureError(f"{name} must be an object, got {_shown(value)}")
    return value


def check_scenarios(scenarios: object) -> None:
    """The results of a record's scenarios whose figures an entry stores, each checked."""
    scenarios = check_mapping("scenarios", scenarios)
    for scenario, (name, key) in SCENARIO_FIGURES.items():
        if scenario in scenarios:
            result = check_mapping(f"scenarios.{scenario}", scenarios[scenario])
            check = check_change if name in _CHANGES else check_figure
            check(f"scenarios.{scenario}.{key}", result.get(key))


def check_breakdown(breakdown: object) -> None:
    """A record's breakdown: the category totals an entry stores, each checked."""
    breakdown = check_mapping("breakdown", breakdown)
    check_categories(breakdown.get("categories") or {}, "breakdown.categories")


def check_categories(categories: object, field: str = "categories") -> None:
    """A record's category totals (``field``), each checked as an entry's figure is."""
    categories = check_mapping(field, categories)
    for name in CATEGORIES:
        if name in categories:
            check_figure(f"{field}.{name}", categories[name])


def check_rank_entries(ranks: object) -> None:
    """A multi-rank record's per-rank entries: each rank number, figure name and figure."""
    if not isinstance(ranks, list):
        raise FigureError(f"ranks must be a list, got {_shown(ranks)}")
    for index, entry in enumerate(ranks):
        where = f"ranks[{index}]"
        entry = check_mapping(where, entry)
        check_rank(f"{where}.rank", entry.get("rank"))
        for name, value in check_mapping(f"{where}.figures", entry.get("figures")).items():
            try:
                check_figure_name(name)
            except FigureError as exc:
                raise FigureError(f"{where}.figures: {exc}") from None
            check_figure(f"{where}.figures.{name}", value)


def _integer(name: str, value: object) -> int:
    """``value`` as a whole number within MAX_FIGURE either way, or FigureError."""
    if isinstance(value, bool) or not isinstance(value, int):
        shown = _shown(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise FigureError(f"{name} is {shown}: {_noun(name)} is a whole number")
        raise FigureError(f"{name} must be an integer {_noun(name)[2:]}, got {shown}")
    if abs(value) > MAX_FIGURE:
        # Counted, not converted: str() of a long enough int raises ValueError.
        raise _too_long(name, _digits(abs(value)))
    return value


def _too_long(name: str, digits: int) -> FigureError:
    if _noun(name) == "a count":
        return FigureError(f"{name} has {digits} digits: a count holds at most {MAX_FIGURE}")
    return FigureError(
        f"{name} has {digits} digits: more bytes than any device holds (at most {MAX_FIGURE})"
    )


def _noun(name: str) -> str:
    """What the figure ``name`` holds, as its messages say it: ``a count`` for ``max_size``
    however it is spelt where it was read (``vram_max_size``, ``scenarios.max_size.value``,
    ``ranks[0].figures.max_size_rank0``), else ``a number of bytes``."""
    parts = name.removeprefix("vram_").split(".")
    figure = parts[-2] if parts[-1] == "value" and len(parts) > 1 else parts[-1]
    count = figure_unit(figure.removeprefix("vram_")) == "count"
    return "a count" if count else "a number of bytes"


def _digits(value: int) -> int:
    """The number of decimal digits of a positive int, without writing it out."""
    digits = max(1, math.floor(value.bit_length() * math.log10(2)))
    return digits + (value >= 10**digits)


def _shown(value: object) -> str:
    try:
        text = repr(value)
    except ValueError:  # an int with more digits than Python writes out
        return f"an integer of {_digits(abs(value))} digits" if isinstance(value, int) else "?"
    return text if len(text) <= 40 else f"{text[:37]}..."
