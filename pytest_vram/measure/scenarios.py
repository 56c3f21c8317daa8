"""The three memory scenarios: idle after emptying the cache, one step, and N steps for leaks.

They drive any :class:`Probe` (the plugin passes the test's measurement), so they run the same
on every backend and without pytest.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import reprlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pytest_vram.attribution.leaks import LeakSiteRecorder, describe_sites, record_leak_sites
from pytest_vram.errors import LeakError
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
    #: How fast the floor of memory (its lower envelope) rose, in bytes per step: over the
    #: confirmation steps when they ran, else over the measured steps.
    sustained_per_step: float
    #: Growth still there after a full garbage collection, or None when none was needed.
    confirmed: int | None
    leaked: bool
    #: Allocated bytes after each confirmation step, run only when a leak was suspected.
    confirmation: list[int] = field(default_factory=list)
    #: Where the storages still alive after the confirmation steps were allocated, largest
    #: first (:class:`~pytest_vram.attribution.leaks.LeakSite`); recorded during them only.
    sites: list[Any] = field(default_factory=list)

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
            **({"sites": [site.to_dict() for site in self.sites]} if self.sites else {}),
        }

    def describe(self) -> str:
        rising = ""
        if self.confirmation:
            rising = f", and its floor kept rising over {len(self.confirmation)} more steps"
        return (
            f"memory grew by {format_delta(self.growth)} over {self.steps} steps after "
            f"{self.warmup} warm-up steps ({format_size(self.baseline)} -> "
            f"{format_size(self.baseline + self.growth)}), its floor rising about "
            f"{format_delta(round(self.sustained_per_step))} every step{rising}; still there "
            f"after garbage collection: {format_delta(self.confirmed or 0)}; tolerance "
            f"{self.tolerance}, about {format_delta(round(self.sustained_per_step * self.steps))} "
            f"over {self.steps} steps"
        )


def check_step_function(scenario: str, fn: object) -> None:
    """ValueError naming ``scenario`` when ``fn`` cannot be called as a step."""
    if not callable(fn):
        raise ValueError(
            f"{scenario}: fn must be a function to call with no arguments (a step), got "
            f"{_shown(fn)}"
        )


def check_leak_arguments(fn: object, steps: object, warmup: object, tolerance: object) -> None:
    """ValueError naming the first argument of ``leak_check`` it cannot use."""
    check_step_function("leak_check", fn)
    for name, value, least in (("steps", steps, 1), ("warmup", warmup, 0)):
        # bool is an int to Python, but True steps is no count.
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(
                f"leak_check: {name} must be a whole number >= {least}, got {_shown(value)}"
            )
    if tolerance is not None:
        try:
            parse_tolerance(tolerance)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"leak_check: {exc}") from None


def _shown(value: object) -> str:
    return f"{reprlib.repr(value)} ({type(value).__name__})"


def empty_cache(probe: Probe) -> EmptyCacheResult:
    """Collect garbage, release cached blocks, and report what stays allocated (idle test)."""
    gc.collect()
    probe.release_cache()
    return EmptyCacheResult(allocated=probe.allocated())


def single_step(probe: Probe, fn: Callable[[], Any]) -> SingleStepResult:
    """Reset the peak, run ``fn()`` once, and report the peak over it.

    A probe with peak windows (the test's measurement) is read through one, so that a
    ``vram.measure()`` block inside the step, or a step inside such a block, costs neither
    its maximum."""
    check_step_function("single_step", fn)
    open_window = getattr(probe, "open_window", None)
    if open_window is None:
        probe.reset_peak()
        before = probe.allocated()
        value = fn()
        return SingleStepResult(
            peak=probe.peak(), before=before, after=probe.allocated(), value=value
        )
    window = open_window()
    before = window.allocated
    try:
        value = fn()
    finally:
        probe.close_window(window)  # type: ignore[attr-defined]
    return SingleStepResult(
        peak=window.allocated, before=before, after=probe.allocated(), value=value
    )


#: The confirmation steps are judged in this many blocks: the chance that the floors of as
#: many blocks of bounded, shuffled memory rise block after block is 1 in 10! (3.6 million).
CONFIRMATION_BLOCKS = 10
#: The confirmation runs at most this many rounds, each twice as long as the one before.
CONFIRMATION_ROUNDS = 3


def _bounds(length: int, blocks: int) -> list[int]:
    return [round(i * length / blocks) for i in range(blocks + 1)]


def block_floors(series: list[int], blocks: int) -> tuple[list[int], list[int]]:
    """The minimum of each of ``blocks`` contiguous, nearly equal parts of ``series``, and
    where each part starts."""
    bounds = _bounds(len(series), min(blocks, len(series)))
    floors = [min(series[a:b]) for a, b in itertools.pairwise(bounds)]
    return floors, bounds[:-1]


def floor_rate(series: list[int], blocks: int) -> float:
    """Bytes per step by which the floor of ``series`` rose: the minimum of its last part
    minus that of its first, over the steps between them (0 when it fell)."""
    floors, starts = block_floors(series, blocks)
    if len(floors) < 2:
        return 0.0
    return max(0.0, (floors[-1] - floors[0]) / (starts[-1] - starts[0]))


def leak_check(
    probe: Probe,
    fn: Callable[[], Any],
    steps: int = 100,
    warmup: int = 3,
    tolerance: str | int | Tolerance | None = None,
) -> LeakCheckResult:
    """Run ``fn()`` ``warmup`` times, then ``steps`` times, and raise :class:`LeakError` when
    the floor of allocated memory keeps rising by more than ``tolerance`` over the steps.

    A leak is memory that keeps growing; memory that goes up and down within a bound (a
    tensor of random size each step, a cache that fills and is cleared, a one-off
    allocation) is not one. So the check judges the floor of memory, the lowest it goes
    over a stretch of steps, which a leak raises and bounded memory does not:

    1. Suspicion: the floor of the last tenth of the steps is above the floor of the first
       tenth (the allocation after the warm-up included), by more than ``tolerance`` when
       that rise goes on for ``steps`` steps. Otherwise the check passes.
    2. Garbage: a full collection, as PyTorch's own CudaMemoryLeakCheck does; when memory
       falls back to the lowest it was, the growth was uncollected reference cycles.
    3. Confirmation: ``fn()`` runs ``max(steps, 20)`` more steps, split into 10 blocks. It
       is a leak when the floor of every block is above the floor of the block before it,
       at a rate that over ``steps`` steps exceeds ``tolerance``. Memory that comes back
       down to the floor of the first half of the measured steps, or whose floor did not
       rise, is bounded and passes. Otherwise the confirmation doubles (at most twice), so
       that a leak hidden in steps whose memory varies by far more than it leaks shows
       through longer blocks.

    Memory that fills over more steps than the check runs looks like a leak: raise
    ``steps``. A periodic leak is caught when it grows at least once every ``steps // 5``
    steps. ``tolerance`` is a size or a percentage of what was allocated after the warm-up;
    None means 0 bytes.
    """
    __tracebackhide__ = True
    check_leak_arguments(fn, steps, warmup, tolerance)
    allowed_tolerance = parse_tolerance(0 if tolerance is None else tolerance)
    for _ in range(warmup):
        fn()
    baseline = probe.allocated()
    per_step = []
    for _ in range(steps):
        fn()
        per_step.append(probe.allocated())
    series = [baseline, *per_step]
    allowed = allowed_tolerance.allowance(baseline)
    sustained = floor_rate(series, CONFIRMATION_BLOCKS)
    confirmed = None
    confirmation: list[int] = []
    leaked = False
    sites: list[Any] = []
    if sustained * steps > allowed:
        gc.collect()
        collected = probe.allocated()
        confirmed = collected - baseline
        if collected - min(series) > allowed:
            recorder = record_leak_sites(probe)
            # The recorder notes where what the steps allocate and keep was allocated.
            with recorder if recorder is not None else contextlib.nullcontext():
                leaked, sustained = _confirm(
                    probe, fn, series, collected, steps, allowed, confirmation, recorder
                )
            if leaked and recorder is not None:
                sites = recorder.sites
    result = LeakCheckResult(
        per_step=per_step,
        baseline=baseline,
        steps=steps,
        warmup=warmup,
        tolerance=allowed_tolerance,
        sustained_per_step=sustained,
        confirmed=confirmed,
        leaked=leaked,
        confirmation=confirmation,
        sites=sites,
    )
    if leaked:
        lines = [f"leak check failed: {result.describe()}"]
        lines += describe_sites(sites, len(confirmation))
        raise LeakError("\n".join(lines), result)
    return result


def _confirm(
    probe: Probe,
    fn: Callable[[], Any],
    series: list[int],
    collected: int,
    steps: int,
    allowed: int,
    confirmation: list[int],
    recorder: LeakSiteRecorder | None = None,
) -> tuple[bool, float]:
    """Run confirmation steps into ``confirmation`` until the floor has either risen block
    after block (a leak) or shown itself bounded; return the verdict and the floor's rate."""
    first_half = series[: len(series) // 2 + 1]
    # The floor the measured steps kept coming back to early on; a leak leaves it behind.
    floors, _ = block_floors(first_half, max(1, CONFIRMATION_BLOCKS // 2))
    floor_before = max(floors)
    if collected < series[-1]:
        # The collection freed cycles that the measured floors counted: start from what it left.
        floor_before = min(floor_before, collected)
    length = max(steps, 2 * CONFIRMATION_BLOCKS)
    rate = 0.0
    for _ in range(CONFIRMATION_ROUNDS):
        while len(confirmation) < length:
            if recorder is not None:
                recorder.next_step()
            fn()
            confirmation.append(probe.allocated())
        rate = floor_rate(confirmation, CONFIRMATION_BLOCKS)
        if rate * steps <= allowed or min(confirmation) <= floor_before:
            return False, rate
        floors, _ = block_floors(confirmation, CONFIRMATION_BLOCKS)
        if all(a < b for a, b in itertools.pairwise(floors)):
            return True, rate
        length *= 2
    return False, rate
