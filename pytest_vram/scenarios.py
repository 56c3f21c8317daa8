"""The three memory scenarios: idle after emptying the cache, one step, and N steps for leaks.

They drive any :class:`Probe` (the plugin passes the test's measurement), so they run the same
on every backend and without pytest.
"""

from __future__ import annotations

import gc
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_vram.units import Tolerance, format_delta, format_size, parse_tolerance

__all__ = [
    "EmptyCacheResult",
    "LeakCheckResult",
    "LeakError",
    "Probe",
    "SingleStepResult",
    "empty_cache",
    "leak_check",
    "single_step",
]


class Probe(Protocol):
    def allocated(self) -> int: ...
    def reset_peak(self) -> None: ...
    def peak(self) -> int: ...
    def release_cache(self) -> None: ...


class LeakError(AssertionError):
    """Memory grew step after step beyond the tolerance; ``result`` holds the figures."""

    def __init__(self, message: str, result: LeakCheckResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass(frozen=True)
class EmptyCacheResult:
    allocated: int

    def to_dict(self) -> dict[str, Any]:
        return {"allocated": self.allocated}


@dataclass(frozen=True)
class SingleStepResult:
    """One run of a step: the peak over it, and allocated bytes before and after it."""

    peak: int
    before: int
    after: int
    value: Any = field(default=None, compare=False, repr=False)

    @property
    def delta(self) -> int:
        return self.peak - self.before

    def to_dict(self) -> dict[str, Any]:
        return {"peak": self.peak, "delta": self.delta, "before": self.before, "after": self.after}


@dataclass(frozen=True)
class LeakCheckResult:
    """Allocated bytes after each measured step, and what they say about a leak."""

    per_step: list[int]
    baseline: int
    steps: int
    warmup: int
    tolerance: Tolerance
    #: Growth per step that recurs through the whole run (one-off allocations excluded).
    sustained_per_step: float
    #: Growth still there after a full garbage collection, or None when none was needed.
    confirmed: int | None
    leaked: bool

    @property
    def growth(self) -> int:
        """Allocated after the last step minus allocated after the warm-up."""
        return (self.per_step[-1] if self.per_step else self.baseline) - self.baseline

    @property
    def growth_per_step(self) -> float:
        return self.growth / self.steps if self.steps else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "per_step": list(self.per_step),
            "growth": self.growth,
            "growth_per_step": self.growth_per_step,
            "sustained_per_step": self.sustained_per_step,
            "steps": self.steps,
            "warmup": self.warmup,
            "tolerance": str(self.tolerance),
            "leaked": self.leaked,
        }

    def describe(self) -> str:
        return (
            f"memory grew by {format_delta(self.growth)} over {self.steps} steps after "
            f"{self.warmup} warm-up steps ({format_size(self.baseline)} -> "
            f"{format_size(self.baseline + self.growth)}), about "
            f"{format_delta(round(self.sustained_per_step))} every step; still there after "
            f"garbage collection: {format_delta(self.confirmed or 0)}; tolerance {self.tolerance}"
        )


def empty_cache(probe: Probe) -> EmptyCacheResult:
    """Collect garbage, release cached blocks, and report what stays allocated (idle test)."""
    gc.collect()
    probe.release_cache()
    return EmptyCacheResult(allocated=probe.allocated())


def single_step(probe: Probe, fn: Callable[[], Any]) -> SingleStepResult:
    """Reset the peak, run ``fn()`` once, and report the peak over it."""
    probe.reset_peak()
    before = probe.allocated()
    value = fn()
    return SingleStepResult(peak=probe.peak(), before=before, after=probe.allocated(), value=value)


def sustained_growth_per_step(series: list[int], segments: int = 5) -> float:
    """Growth per step that recurs: the second-fastest growth among ``segments`` equal parts
    of ``series``. A one-off allocation lands in one part and is ignored; a leak, steady,
    periodic or starting late, grows in at least two parts."""
    steps = len(series) - 1
    if steps < 2:
        return float(max(0, series[-1] - series[0])) if steps == 1 else 0.0
    count = min(segments, steps)
    bounds = [round(i * steps / count) for i in range(count + 1)]
    rates = sorted(
        (series[end] - series[start]) / (end - start) for start, end in itertools.pairwise(bounds)
    )
    return max(0.0, rates[-2])


def leak_check(
    probe: Probe,
    fn: Callable[[], Any],
    steps: int = 100,
    warmup: int = 3,
    tolerance: str | int | Tolerance | None = None,
) -> LeakCheckResult:
    """Run ``fn()`` ``warmup`` times, then ``steps`` times, and raise :class:`LeakError` when
    allocated memory keeps growing by more than ``tolerance`` over the steps.

    ``tolerance`` is a size or a percentage of what was allocated after the warm-up; None
    means 0 bytes. A suspected leak is confirmed after a full garbage collection, as PyTorch's
    own CudaMemoryLeakCheck does, so reference cycles that are merely uncollected do not count.
    """
    __tracebackhide__ = True
    if steps < 1 or warmup < 0:
        raise ValueError(f"leak_check needs steps >= 1 and warmup >= 0, got {steps=} {warmup=}")
    allowed_tolerance = parse_tolerance(0 if tolerance is None else tolerance)
    for _ in range(warmup):
        fn()
    baseline = probe.allocated()
    per_step = []
    for _ in range(steps):
        fn()
        per_step.append(probe.allocated())
    sustained = sustained_growth_per_step([baseline, *per_step])
    allowed = allowed_tolerance.allowance(baseline)
    confirmed = None
    leaked = False
    if sustained * steps > allowed and per_step[-1] - baseline > allowed:
        gc.collect()
        confirmed = probe.allocated() - baseline
        leaked = confirmed > allowed
    result = LeakCheckResult(
        per_step=per_step,
        baseline=baseline,
        steps=steps,
        warmup=warmup,
        tolerance=allowed_tolerance,
        sustained_per_step=sustained,
        confirmed=confirmed,
        leaked=leaked,
    )
    if leaked:
        raise LeakError(f"leak check failed: {result.describe()}", result)
    return result
