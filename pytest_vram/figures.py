"""The figures a test stores, and the one check of a figure read back.

A baseline entry maps figure names to bytes (and ``max_size`` to a count: the largest size of
a step that fits). The names are the measured figures below, the
category totals at the peak (``peak_parameters`` ...) and, for a multi-rank test, each rank's own
copy of either (``peak_allocated_rank1``). Whatever reads figures from outside the process (a
baseline file, a ``--vram-json`` shard, a JUnit property) checks them here, so a value that one
reader would refuse is never written by another.
"""

from __future__ import annotations

import math
import re

__all__ = [
    "CATEGORY_FIGURES",
    "LARGER_IS_BETTER",
    "MAX_FIGURE",
    "MAX_RANK",
    "MEASURED_FIGURES",
    "FigureError",
    "check_change",
    "check_entry",
    "check_figure",
    "check_figure_name",
    "check_nodeid",
    "check_rank",
    "check_text",
    "figure_from_text",
    "is_known_figure",
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
#: Figures where a lower value is the regression.
LARGER_IS_BETTER = frozenset({"max_size"})
#: Category totals at the peak (see :mod:`pytest_vram.attribution.breakdown`).
CATEGORY_FIGURES = tuple(
    f"peak_{name}"
    for name in ("parameters", "gradients", "optimizer", "activations", "temporaries", "other")
)
_KNOWN = frozenset(MEASURED_FIGURES + CATEGORY_FIGURES)
# One rank's copy of a figure (pytest_vram.distributed.RANK_SUFFIX).
_RANK_COPY = re.compile(r"(.+)_rank(0|[1-9][0-9]{0,5})")
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
    """``value`` as a number of bytes, or FigureError saying why it is not one."""
    value = _integer(name, value)
    if value < 0:
        raise FigureError(f"{name} is {value}: a number of bytes is never negative")
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
        raise FigureError(f"{name} must be an integer number of bytes, got {_shown(text)}")
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


def _integer(name: str, value: object) -> int:
    """``value`` as a whole number within MAX_FIGURE either way, or FigureError."""
    if isinstance(value, bool) or not isinstance(value, int):
        shown = _shown(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise FigureError(f"{name} is {shown}: a number of bytes is a whole number")
        raise FigureError(f"{name} must be an integer number of bytes, got {shown}")
    if abs(value) > MAX_FIGURE:
        # Counted, not converted: str() of a long enough int raises ValueError.
        raise _too_long(name, _digits(abs(value)))
    return value


def _too_long(name: str, digits: int) -> FigureError:
    return FigureError(
        f"{name} has {digits} digits: more bytes than any device holds (at most {MAX_FIGURE})"
    )


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
