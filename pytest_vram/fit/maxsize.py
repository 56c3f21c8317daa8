"""``vram.max_size``: the largest size of a step that fits a capacity, and what it needs there."""

from __future__ import annotations

import inspect
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pytest_vram.fit.search import NoAnswer, Unbounded, largest
from pytest_vram.fit.trials import Attempt, trials_for
from pytest_vram.fit.wording import at
from pytest_vram.units import ACCEPTED_SIZE_FORMS, SizeError, format_size, is_si, parse_size

_AS_TYPED = re.compile(r"\s*([0-9.]+)\s*([A-Za-z]+)\s*$")
# The most bytes a figure holds (a 64-bit count), as everywhere sizes are stored.
_MAX_BYTES = 2**63 - 1

__all__ = ["MaxSizeResult", "check_arguments", "describe_capacity", "grew", "knob_name", "max_size"]


@dataclass(frozen=True)
class MaxSizeResult:
    """The largest ``value`` whose step fits ``capacity``, and the peaks either side of it."""

    value: int
    #: The peak at ``value`` (reserved memory on sim and cuda); None when nothing fit.
    peak: int | None
    #: The peak at ``value + 1`` or, where a real device could not run it, what the allocation
    #: that failed asked for on top of what was held; None when ``value`` is ``hi``.
    next_peak: int | None
    capacity: int
    #: The capacity as it was given (``"80GB"``), for messages.
    capacity_text: str
    #: The step's parameter: ``batch``, ``seq``...
    knob: str
    #: Which memory ``peak`` counts: ``reserved`` or ``allocated``.
    metric: str
    #: What grew from ``value`` to ``value + 1``, by category (bytes), where broken down.
    grew: dict[str, int] | None = None
    #: Every size tried and its peak, None where it did not fit.
    tried: dict[int, int | None] = field(default_factory=dict)
    seconds: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "peak": self.peak,
            "next_peak": self.next_peak,
            "capacity": self.capacity,
            "capacity_text": self.capacity_text,
            "knob": self.knob,
            "metric": self.metric,
            "grew": dict(self.grew) if self.grew is not None else None,
            "tried": {str(size): peak for size, peak in sorted(self.tried.items())},
            "seconds": round(self.seconds, 3),
        }

    def describe(self) -> str:
        """``largest batch that fits 80 GB: 12 (at 12: 72.60 GiB; 13 needs 76.10 GiB:
        activations +3.10 GiB)``."""
        peaks = at(self.to_dict())
        return f"largest {self.knob} that fits {self.capacity_text}: {self.value} ({peaks})"


def grew(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """The change of each category from ``before`` to ``after``."""
    if before is None or after is None:
        return None
    return {name: after.get(name, 0) - before.get(name, 0) for name in after}


def knob_name(step: Callable[..., Any]) -> str:
    """The name of the step's first parameter (``batch``), or ``size``."""
    try:
        parameters = list(inspect.signature(step).parameters)
    except (TypeError, ValueError):
        return "size"
    return parameters[0] if parameters else "size"


def describe_capacity(capacity: int | str) -> str:
    """``80 GB`` for ``"80GB"``, ``74.51 GiB`` for the same count of bytes."""
    if is_si(capacity):
        match = _AS_TYPED.match(str(capacity))
        if match:
            return f"{match.group(1)} {match.group(2)}"
    return format_size(parse_size(capacity))


def check_arguments(capacity: object, lo: object, hi: object) -> int:
    """The capacity in bytes; ValueError (a SizeError for the capacity) naming a bad value."""
    limit = parse_size(capacity)
    if limit > _MAX_BYTES:
        count = "" if isinstance(capacity, int) else f"that is {limit} bytes, "
        raise SizeError(
            f"invalid size {capacity!r}: {count}more than a 64-bit byte count holds "
            f"({_MAX_BYTES}); expected {ACCEPTED_SIZE_FORMS}"
        )
    for name, bound in (("lo", lo), ("hi", hi)):
        if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int)):
            raise ValueError(f"max_size: {name} must be an int, got {bound!r}")
    if lo is None or lo < 1 or (hi is not None and hi < lo):  # type: ignore[operator]
        raise ValueError(f"max_size needs 1 <= lo <= hi, got lo={lo!r}, hi={hi!r}")
    return limit


def max_size(
    backend: Any,
    step: Callable[[int], Any],
    capacity: int | str,
    *,
    lo: int = 1,
    hi: int | None = None,
    breakdown: bool = True,
) -> MaxSizeResult:
    """The largest ``n`` in ``[lo, hi]`` for which ``step(n)`` fits ``capacity`` on
    ``backend`` (see :mod:`pytest_vram.fit.trials` for what fits means on each)."""
    limit = check_arguments(capacity, lo, hi)
    trials = trials_for(backend)
    tried: dict[int, Attempt] = {}
    start = time.perf_counter()

    def fits(size: int) -> bool:
        tried[size] = trials.attempt(step, size, limit, breakdown=breakdown)
        return tried[size].fits

    knob = knob_name(step)
    try:
        # A step whose memory grows by a byte with each unit of n needs more than the
        # capacity at n = capacity + 1: no larger size is worth trying.
        value = largest(fits, lo, hi, ceiling=max(lo, limit + 1))
    except Unbounded as exc:
        raise NoAnswer(
            f"step({knob}) fits {describe_capacity(capacity)} at every {knob} tried, up to "
            f"{exc.size}: its memory does not grow with {knob}, or not by a byte per unit. "
            f"Give hi= (the largest {knob} worth trying) to bound the search"
        ) from None
    next_size = value + 1 if hi is None or value < hi else None
    at_next = tried.get(next_size) if next_size is not None else None
    if at_next is not None and at_next.cut_short and trials.measures_beyond:
        # What the size that did not fit needs, measured whole without the capacity.
        at_next = trials.attempt(step, at_next.size, None, breakdown=breakdown)
    at_value = tried.get(value)
    next_peak = None
    if at_next is not None and at_next.cut_short:
        # Stopped short, it needs what it asked for where that is known; else no figure.
        next_peak = at_next.asked or None
    elif at_next is not None:
        next_peak = at_next.peak
    return MaxSizeResult(
        value=value,
        peak=at_value.peak if at_value is not None else None,
        next_peak=next_peak,
        capacity=limit,
        capacity_text=describe_capacity(capacity),
        knob=knob,
        metric=trials.metric,
        grew=grew(
            at_value.categories if at_value is not None else {},
            at_next.categories if at_next is not None else None,
        ),
        tried={size: a.peak if a.fits else None for size, a in tried.items()},
        seconds=time.perf_counter() - start,
    )
