"""A test's figures against its baseline entry: which grew beyond the tolerance, which
improved, and the words a message uses for each."""

from __future__ import annotations

from dataclasses import dataclass

from pytest_vram.record.figures import (
    COMPARED_FIGURES,
    LARGER_IS_BETTER,
    MEASURED_FIGURES,
    figure_unit,
    measured_name,
)
from pytest_vram.units import Tolerance, format_delta, format_percent, format_size

__all__ = ["FigureChange", "compare_with_entry", "unmeasured_figures"]


@dataclass(frozen=True)
class FigureChange:
    """One figure of a test against the same figure in its baseline entry."""

    figure: str
    baseline: int
    current: int
    tolerance: Tolerance

    @property
    def delta(self) -> int:
        return self.current - self.baseline

    @property
    def percent(self) -> float | None:
        return None if self.baseline == 0 else 100.0 * self.delta / self.baseline

    @property
    def allowance(self) -> int:
        return self.tolerance.allowance(self.baseline)

    @property
    def larger_is_better(self) -> bool:
        return self.figure in LARGER_IS_BETTER

    @property
    def regressed(self) -> bool:
        # A count such as the largest batch that fits has no tolerance: one less is a loss.
        if self.larger_is_better:
            return self.delta < 0
        return self.delta > self.allowance

    @property
    def improved(self) -> bool:
        if self.larger_is_better:
            return self.delta > 0
        return -self.delta > self.allowance

    def beyond(self, floor: int) -> bool:
        """Whether the change is more than ``floor`` bytes either way; a count always is."""
        return figure_unit(self.figure) == "count" or abs(self.delta) > floor

    def describe(self) -> str:
        if figure_unit(self.figure) == "count":  # a count has no size, and no tolerance
            return (
                f"{COMPARED_FIGURES.get(self.figure, self.figure)}: "
                f"{self.baseline} -> {self.current}"
            )
        percent = "" if self.percent is None else f", {format_percent(self.percent)}"
        return (
            f"{COMPARED_FIGURES.get(self.figure, self.figure)} {format_size(self.current)} "
            f"against baseline {format_size(self.baseline)} "
            f"({format_delta(self.delta)}{percent}; tolerance {self.tolerance})"
        )


def compare_with_entry(
    current: dict[str, int], entry: dict[str, int], tolerance: Tolerance
) -> list[FigureChange]:
    """The compared figures present in both ``current`` and the baseline ``entry``, in
    COMPARED_FIGURES order."""
    return [
        FigureChange(name, entry[name], current[name], tolerance)
        for name in COMPARED_FIGURES
        if name in current and name in entry
    ]


def unmeasured_figures(current: dict[str, int], entry: dict[str, int]) -> dict[str, int]:
    """The measured figures (and their rank copies) that ``entry`` stores and ``current``
    lacks, with their stored values. Category totals are left out: a category absent at the
    peak held no bytes."""
    return {
        name: value
        for name, value in entry.items()
        if name not in current and measured_name(name) in MEASURED_FIGURES
    }
