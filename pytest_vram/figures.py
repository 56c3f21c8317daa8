"""The figures a test stores, and the one check of a figure read back.

A baseline entry maps figure names to bytes. The names are the measured figures below, the
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
    "MAX_FIGURE",
    "MEASURED_FIGURES",
    "FigureError",
    "check_figure",
    "check_figure_name",
    "check_nodeid",
    "is_known_figure",
]

#: The largest number of bytes a figure may hold: a signed 64-bit integer, as PyTorch and
#: NVML count bytes. A larger value is a corrupt file, not a measurement.
MAX_FIGURE = 2**63 - 1

#: Figures a measurement makes.
MEASURED_FIGURES = (
    "peak_allocated",
    "peak_reserved",
    "peak_device",
    "idle",
    "single_step_peak",
    "leak_growth",
)
#: Category totals at the peak (see :mod:`pytest_vram.attribution.breakdown`).
CATEGORY_FIGURES = tuple(
    f"peak_{name}"
    for name in ("parameters", "gradients", "optimizer", "activations", "temporaries", "other")
)
_KNOWN = frozenset(MEASURED_FIGURES + CATEGORY_FIGURES)
# One rank's copy of a figure (pytest_vram.distributed.RANK_SUFFIX).
_RANK_COPY = re.compile(r"(.+)_rank(0|[1-9][0-9]{0,5})")


class FigureError(ValueError):
    """A figure, figure name or node id that is not what pytest-vram stores.

    The message says what is wrong with the value; the caller adds where it was read.
    """


def is_known_figure(name: str) -> bool:
    """Whether ``name`` is a figure pytest-vram stores."""
    if name in _KNOWN:
        return True
    match = _RANK_COPY.fullmatch(name)
    return match is not None and match.group(1) in _KNOWN


def check_figure_name(name: object) -> str:
    if not isinstance(name, str):
        raise FigureError(f"a figure name must be text, got {name!r}")
    if not is_known_figure(name):
        raise FigureError(
            f"unknown figure {name!r}; known figures are {', '.join(sorted(_KNOWN))} "
            "(and their per-rank copies, such as peak_allocated_rank1)"
        )
    return name


def check_figure(name: str, value: object) -> int:
    """``value`` as a number of bytes, or FigureError saying why it is not one."""
    if isinstance(value, bool) or not isinstance(value, int):
        shown = _shown(value)
        if isinstance(value, float) and not math.isfinite(value):
            raise FigureError(f"{name} is {shown}: a number of bytes is a whole number")
        raise FigureError(f"{name} must be an integer number of bytes, got {shown}")
    if value < 0:
        raise FigureError(f"{name} is {value}: a number of bytes is never negative")
    if value > MAX_FIGURE:
        raise FigureError(
            f"{name} has {len(str(value))} digits: more bytes than any device holds "
            f"(at most {MAX_FIGURE})"
        )
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


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else f"{text[:37]}..."
