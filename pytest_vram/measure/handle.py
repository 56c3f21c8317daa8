"""The object the ``vram`` fixture gives a test: its device, the three scenarios and the
largest size that fits."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import pytest

from pytest_vram.errors import UsageError
from pytest_vram.measure import scenarios
from pytest_vram.measure.measurement import TestMeasurement
from pytest_vram.units import Tolerance

if TYPE_CHECKING:
    import torch

    from pytest_vram.fit import MaxSizeResult

__all__ = ["Measured", "VramHandle"]


class Measured:
    """The figures of one ``with vram.measure()`` block; valid after the block ends."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.peak = start
        self.end = start

    @property
    def delta(self) -> int:
        return self.peak - self.start

    def __repr__(self) -> str:
        return f"Measured(start={self.start}, peak={self.peak}, end={self.end})"


class VramHandle:
    """Memory measurement for the current test. Scenario results are recorded for the test
    and stored in its baseline."""

    def __init__(self, measurement: TestMeasurement) -> None:
        self._measurement = measurement

    @property
    def device(self) -> torch.device:
        """Where to put tensors: ``cuda:N`` on the cuda backend, ``cpu`` on cpu and sim, and
        ``cuda:0`` on sim where host tensors are kept on the host."""
        return self._measurement.backend.device

    @property
    def backend(self) -> str:
        return self._measurement.backend.name

    def allocated(self) -> int:
        """Bytes allocated on the device now."""
        return self._measurement.allocated()

    @contextmanager
    def measure(self) -> Iterator[Measured]:
        """``with vram.measure() as m:`` then ``m.peak``, ``m.start``, ``m.end``, ``m.delta``."""
        window = self._measurement.open_window()
        measured = Measured(window.allocated)
        try:
            yield measured
        finally:
            self._measurement.close_window(window)
            measured.peak = window.allocated
            measured.end = self._measurement.allocated()

    def empty_cache(self) -> int:
        """Collect garbage, release cached blocks, return the bytes still allocated."""
        result = scenarios.empty_cache(self._measurement)
        self._record("empty_cache", result.to_dict())
        return result.allocated

    def single_step(self, fn: Callable[[], Any]) -> scenarios.SingleStepResult:
        """Reset the peak, run ``fn()`` once; the result has ``.peak``, ``.delta``,
        ``.before``, ``.after`` and ``.value`` (what ``fn`` returned)."""
        __tracebackhide__ = True
        self._check(scenarios.check_step_function, "single_step", fn)
        result = scenarios.single_step(self._measurement, fn)
        self._record("single_step", result.to_dict())
        return result

    def leak_check(
        self,
        fn: Callable[[], Any],
        steps: int = 100,
        warmup: int = 3,
        tolerance: str | int | Tolerance | None = None,
    ) -> scenarios.LeakCheckResult:
        """Run ``fn()`` ``warmup`` times, then ``steps`` times; fail the test when memory keeps
        growing by more than ``tolerance`` (None: 0 bytes)."""
        __tracebackhide__ = True
        self._check(scenarios.check_leak_arguments, fn, steps, warmup, tolerance)
        try:
            result = scenarios.leak_check(self._measurement, fn, steps, warmup, tolerance)
        except scenarios.LeakError as exc:
            self._record("leak_check", exc.result.to_dict())
            raise
        self._record("leak_check", result.to_dict())
        return result

    def max_size(
        self,
        step: Callable[[int], Any],
        capacity: int | str,
        *,
        lo: int = 1,
        hi: int | None = None,
    ) -> MaxSizeResult:
        """The largest ``n`` in ``[lo, hi]`` for which ``step(n)`` fits ``capacity``: on sim
        by search, counting reserved memory as the allocator needs it; on cuda by real
        out-of-memory errors. The result has ``.value``, ``.peak`` (at ``value``) and
        ``.next_peak`` (at ``value + 1``); the value is stored in the baseline, and a lower
        one fails the test. The search's attempts do not count in the test's own peak."""
        from pytest_vram.fit.maxsize import check_arguments, max_size
        from pytest_vram.fit.search import NoAnswer

        __tracebackhide__ = True
        nodeid = self._measurement.record.nodeid
        if "max_size" in self._measurement.record.scenarios:
            raise UsageError(
                f"{nodeid}: vram.max_size was already called in this test; a baseline keeps "
                "one largest size per test: parametrize the test for another step or capacity"
            )
        try:
            check_arguments(capacity, lo, hi)
        except ValueError as exc:
            raise UsageError(f"{nodeid}: vram.max_size: {exc}") from None
        # What the test did before the search keeps its peak; the attempts do not add theirs.
        self._measurement.reset_peak()
        try:
            result = max_size(self._measurement.backend, step, capacity, lo=lo, hi=hi)
        except NoAnswer as exc:
            why = str(exc)
        else:
            why = None
        finally:
            self._measurement.backend.reset_peak()
        if why is not None:  # no figure rather than a wrong one: the test fails, saying why
            pytest.fail(f"vram.max_size: {why}", pytrace=False)
        self._record("max_size", result.to_dict())
        return result

    def _check(self, check: Callable[..., None], *arguments: object) -> None:
        """A scenario's arguments, checked before it runs: a UsageError naming the test, the
        scenario and the argument, as ``max_size`` gives, never a TypeError from within."""
        __tracebackhide__ = True
        try:
            check(*arguments)
        except ValueError as exc:
            raise UsageError(f"{self._measurement.record.nodeid}: vram.{exc}") from None

    def _record(self, name: str, figures: dict[str, Any]) -> None:
        self._measurement.record.scenarios[name] = figures
