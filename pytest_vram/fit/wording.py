"""How a ``vram.max_size`` result is worded: the peaks either side of the largest size that fits.

Read by the judge from a stored figure and by the result itself, without the search machinery.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vram.record.figures import category_label
from pytest_vram.units import format_delta, format_size

__all__ = ["at", "grew_text"]


def at(data: Mapping[str, Any]) -> str:
    """What the peaks either side of the value were, as messages give them, from a stored
    ``max_size`` figure (:meth:`MaxSizeResult.to_dict`)."""
    value, peak, next_peak = data["value"], data.get("peak"), data.get("next_peak")
    parts = [f"at {value}: {format_size(peak)}" if peak is not None else "nothing fits"]
    if next_peak is not None:
        grown = grew_text(data.get("grew"))
        parts.append(
            f"{value + 1} needs {format_size(next_peak)}" + (f": {grown}" if grown else "")
        )
    return "; ".join(parts)


def grew_text(grew: dict[str, int] | None) -> str:
    """``activations +3.10 GiB, gradients +12.00 MiB``: what grew, the most first."""
    if not grew:
        return ""
    changed = sorted(((delta, name) for name, delta in grew.items() if delta), reverse=True)
    return ", ".join(f"{category_label(name)} {format_delta(delta)}" for delta, name in changed)
