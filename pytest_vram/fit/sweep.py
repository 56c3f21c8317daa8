"""The largest size for several capacities at once, sharing the attempts between them.

Whether a size fits is monotone in the capacity: a step that fit a capacity fits any larger
one, and one that did not fit a capacity does not fit a smaller one. So an attempt answers for
more than its own capacity, and a table of seven GPU sizes costs far fewer steps than seven
searches.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pytest_vram.fit.search import largest
from pytest_vram.fit.trials import Attempt, PeakTrials

__all__ = ["Fit", "sweep"]


@dataclass(frozen=True)
class Fit:
    """The answer for one capacity."""

    capacity: int
    value: int
    #: The peak at ``value`` (None when nothing fit) and at ``value + 1`` (None past ``hi``).
    peak: int | None
    next_peak: int | None


class _Known:
    """Per size: the smallest capacity it fit and the largest it did not, and its peaks."""

    def __init__(self) -> None:
        self.fit_at: dict[int, int] = {}
        self.failed_at: dict[int, int] = {}
        self.peak: dict[int, int] = {}
        #: The whole step's peak, measured without a capacity or within one.
        self.whole: dict[int, int] = {}

    def answer(self, size: int, capacity: int) -> bool | None:
        if capacity >= self.fit_at.get(size, 1 << 80):
            return True
        if capacity <= self.failed_at.get(size, -1):
            return False
        whole = self.whole.get(size)
        if whole is not None and whole <= capacity:
            return True  # it never needed more than this capacity
        return None

    def note(self, attempt: Attempt, capacity: int | None) -> None:
        size = attempt.size
        if attempt.fits:
            self.whole[size] = attempt.peak
            if capacity is not None:
                self.fit_at[size] = min(self.fit_at.get(size, capacity), capacity)
        elif capacity is not None:
            self.failed_at[size] = max(self.failed_at.get(size, capacity), capacity)


def sweep(
    trials: PeakTrials,
    step: Callable[[int], Any],
    capacities: Sequence[int],
    *,
    lo: int = 1,
    hi: int | None = None,
    on_attempt: Callable[[int, int, bool], None] | None = None,
) -> list[Fit]:
    """For each capacity (in the order given), the largest size in ``[lo, hi]`` whose step
    fits it, and the peaks at that size and the next; ``on_attempt(size, capacity, fits)``
    hears of every step run."""
    known = _Known()

    def run(size: int, capacity: int | None) -> Attempt:
        attempt = trials.attempt(step, size, capacity, breakdown=False)
        known.note(attempt, capacity)
        if on_attempt is not None:
            on_attempt(size, capacity or 0, attempt.fits)
        return attempt

    fits_found = []
    # Smallest first: a small capacity fails early (cheap), and what fits it fits the rest.
    for capacity in sorted(set(capacities)):

        def fits(size: int, capacity: int = capacity) -> bool:
            answer = known.answer(size, capacity)
            if answer is None:
                answer = run(size, capacity).fits
            return answer

        value = largest(fits, lo, hi)
        fits_found.append((capacity, value))
    results = {}
    for capacity, value in fits_found:
        peak = known.whole.get(value) if value >= lo else None
        next_size = value + 1 if hi is None or value < hi else None
        next_peak = None
        if next_size is not None:
            if next_size not in known.whole:
                run(next_size, None)  # measured whole, past the capacity
            next_peak = known.whole.get(next_size)
        results[capacity] = Fit(capacity, value, peak, next_peak)
    return [results[capacity] for capacity in capacities]
