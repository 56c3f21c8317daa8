"""The three scenarios (empty cache, single step, leak check) on a fake probe and on the cpu
backend driven through the test measurement."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import nn

from pytest_vram.backends.cpu.backend import CpuBackend
from pytest_vram.measure.measurement import TestMeasurement
from pytest_vram.measure.scenarios import (
    LeakCheckResult,
    LeakError,
    empty_cache,
    leak_check,
    single_step,
)
from pytest_vram.units import Tolerance, parse_tolerance

TENSOR_512_BYTES = 128  # torch.ones(128) is 128 float32 values: 512 bytes


class FakeProbe:
    """A byte counter the step functions move by hand."""

    def __init__(self, allocated: int = 0) -> None:
        self.current = allocated
        self.high = allocated
        self.resets = 0
        self.releases = 0

    def alloc(self, nbytes: int) -> None:
        self.current += nbytes
        self.high = max(self.high, self.current)

    def free(self, nbytes: int) -> None:
        self.current -= nbytes

    def allocated(self) -> int:
        return self.current

    def reset_peak(self) -> None:
        self.resets += 1
        self.high = self.current

    def peak(self) -> int:
        return self.high

    def release_cache(self) -> None:
        self.releases += 1


class Counter:
    """Counts calls; ``leak_check`` calls the step warmup + steps times."""

    def __init__(self, step: Callable[[int], Any]) -> None:
        self.calls = 0
        self._step = step

    def __call__(self) -> Any:
        self.calls += 1
        return self._step(self.calls)


@pytest.fixture
def probe() -> FakeProbe:
    return FakeProbe(allocated=10_000)


@pytest.fixture
def measurement() -> Iterator[TestMeasurement]:
    m = TestMeasurement(CpuBackend(), "tests/test_scenarios.py::test_x")
    m.begin()
    try:
        yield m
    finally:
        m.end()
        m.backend.close()


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    """Reference cycles stay until someone calls gc.collect()."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class Cycle:
    """A reference cycle holding a value: only the cycle collector frees it."""

    def __init__(self, value: Any) -> None:
        self.me = self
        self.value = value


# -- empty_cache ---------------------------------------------------------------------------


def test_empty_cache_releases_the_cache_and_reports_allocated(probe: FakeProbe) -> None:
    result = empty_cache(probe)
    assert result.allocated == 10_000
    assert probe.releases == 1
    assert result.to_dict() == {"allocated": 10_000}


def test_empty_cache_collects_garbage_first(probe: FakeProbe, no_automatic_gc: None) -> None:
    garbage = Cycle(None)
    probe.alloc(4096)
    weakref.finalize(garbage, probe.free, 4096)
    del garbage
    assert probe.allocated() == 14_096
    assert empty_cache(probe).allocated == 10_000


def test_empty_cache_on_cpu_backend(measurement: TestMeasurement, no_automatic_gc: None) -> None:
    kept = torch.ones(256)
    garbage = Cycle(torch.ones(TENSOR_512_BYTES))
    del garbage
    assert measurement.allocated() == 1024 + 512
    assert empty_cache(measurement).allocated == 1024
    del kept


# -- single_step ---------------------------------------------------------------------------


def test_single_step_figures(probe: FakeProbe) -> None:
    def step() -> str:
        probe.alloc(5000)
        probe.free(4000)
        return "done"

    result = single_step(probe, step)
    assert result.before == 10_000
    assert result.peak == 15_000
    assert result.delta == 5000
    assert result.after == 11_000
    assert result.value == "done"
    assert result.to_dict() == {"peak": 15_000, "delta": 5000, "before": 10_000, "after": 11_000}


def test_single_step_resets_the_peak_first(probe: FakeProbe) -> None:
    probe.alloc(1_000_000)
    probe.free(1_000_000)

    result = single_step(probe, lambda: probe.alloc(100))
    assert probe.resets == 1
    assert result.peak == 10_100
    assert result.delta == 100


def test_single_step_that_frees_memory(probe: FakeProbe) -> None:
    result = single_step(probe, lambda: probe.free(4000))
    assert result.peak == 10_000
    assert result.delta == 0
    assert result.after == 6000


def test_single_step_propagates_the_step_error(probe: FakeProbe) -> None:
    def step() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        single_step(probe, step)


def test_single_step_on_cpu_backend(measurement: TestMeasurement) -> None:
    held = torch.ones(256)  # 1 KiB that lives through the step

    def step() -> torch.Tensor:
        scratch = torch.ones(1024)  # 4 KiB, freed when the step returns
        return scratch[:TENSOR_512_BYTES].clone()  # 512 bytes that outlive it

    result = single_step(measurement, step)
    assert result.before == 1024
    assert result.peak == 1024 + 4096 + 512
    assert result.delta == 4096 + 512
    assert result.after == 1024 + 512
    assert isinstance(result.value, torch.Tensor)
    assert result.value.shape == (TENSOR_512_BYTES,)
    del held


# -- leak_check on the fake probe ------------------------------------------------------------


def test_leak_check_without_growth(probe: FakeProbe) -> None:
    step = Counter(lambda i: (probe.alloc(2048), probe.free(2048)))
    result = leak_check(probe, step, steps=20, warmup=2)
    assert isinstance(result, LeakCheckResult)
    assert step.calls == 22
    assert result.per_step == [10_000] * 20
    assert result.baseline == 10_000
    assert result.growth == 0
    assert result.growth_per_step == 0
    assert not result.leaked
    assert result.confirmed is None


def test_leak_check_defaults_to_100_steps_after_3_warmup_steps(probe: FakeProbe) -> None:
    step = Counter(lambda i: None)
    result = leak_check(probe, step)
    assert step.calls == 103
    assert result.steps == 100
    assert result.warmup == 3
    assert len(result.per_step) == 100


def test_leak_check_baseline_is_taken_after_warmup(probe: FakeProbe) -> None:
    # The first steps fill caches (optimizer state, say); only later growth counts.
    step = Counter(lambda i: probe.alloc(100_000) if i <= 3 else None)
    result = leak_check(probe, step, steps=10, warmup=3)
    assert result.baseline == 310_000
    assert result.growth == 0


def test_leak_check_finds_a_steady_leak(probe: FakeProbe) -> None:
    step = Counter(lambda i: probe.alloc(512))
    with pytest.raises(LeakError) as info:
        leak_check(probe, step, steps=100, warmup=3, tolerance="0B")
    result = info.value.result
    baseline = 10_000 + 3 * 512
    assert result.baseline == baseline
    assert result.per_step == [baseline + 512 * (i + 1) for i in range(100)]
    assert result.growth == 51_200
    assert result.growth_per_step == 512
    assert result.sustained_per_step == 512
    assert result.confirmed == 51_200
    assert result.leaked
    assert isinstance(info.value, AssertionError)


def test_leak_error_message_states_the_growth(probe: FakeProbe) -> None:
    with pytest.raises(LeakError) as info:
        leak_check(probe, lambda: probe.alloc(512), steps=100, warmup=3)
    message = str(info.value)
    assert "+50.00 KiB" in message
    assert "100 steps" in message
    assert "+512 B every step" in message


def test_leak_check_default_tolerance_is_zero_bytes(probe: FakeProbe) -> None:
    with pytest.raises(LeakError) as info:
        leak_check(probe, lambda: probe.alloc(1), steps=30, warmup=0)
    assert info.value.result.growth == 30
    assert info.value.result.tolerance.allowance(10**9) == 0


def test_leak_check_size_tolerance(probe: FakeProbe) -> None:
    # 512 bytes a step over 100 steps: 50 KiB.
    result = leak_check(probe, lambda: probe.alloc(512), steps=100, tolerance="64KiB")
    assert not result.leaked
    assert result.growth == 51_200
    with pytest.raises(LeakError):
        leak_check(probe, lambda: probe.alloc(512), steps=100, tolerance="32KiB")


def test_leak_check_percentage_tolerance_is_of_the_allocation_after_warmup() -> None:
    # After the warm-up 1,000,000 bytes are allocated; 100 steps then add 512 each: 5.12%.
    probe = FakeProbe(allocated=1_000_000)
    result = leak_check(probe, lambda: probe.alloc(512), steps=100, warmup=0, tolerance="6%")
    assert not result.leaked
    assert result.growth == 51_200

    probe = FakeProbe(allocated=1_000_000)
    with pytest.raises(LeakError) as info:
        leak_check(probe, lambda: probe.alloc(512), steps=100, warmup=0, tolerance="5%")
    assert str(info.value.result.tolerance) == "5%"


def test_leak_check_accepts_a_tolerance_object(probe: FakeProbe) -> None:
    tolerance = Tolerance(nbytes=100_000)
    result = leak_check(probe, lambda: probe.alloc(512), steps=100, tolerance=tolerance)
    assert result.tolerance == tolerance
    assert not result.leaked


def test_leak_check_rejects_a_bad_tolerance(probe: FakeProbe) -> None:
    with pytest.raises(ValueError, match="5 percent"):
        leak_check(probe, lambda: None, steps=3, tolerance="5 percent")


def test_leak_check_ignores_a_one_off_allocation(probe: FakeProbe) -> None:
    step = Counter(lambda i: probe.alloc(1_000_000) if i == 50 else None)
    result = leak_check(probe, step, steps=100, warmup=3)
    assert not result.leaked
    assert result.growth == 1_000_000


def test_leak_check_finds_a_periodic_leak(probe: FakeProbe) -> None:
    step = Counter(lambda i: probe.alloc(1536) if i % 3 == 0 else None)
    with pytest.raises(LeakError) as info:
        leak_check(probe, step, steps=100, warmup=3)
    assert info.value.result.growth == 33 * 1536


def test_leak_check_finds_a_leak_that_starts_during_the_run(probe: FakeProbe) -> None:
    step = Counter(lambda i: probe.alloc(512) if i > 43 else None)
    with pytest.raises(LeakError):
        leak_check(probe, step, steps=100, warmup=3)


def test_leak_check_short_runs(probe: FakeProbe) -> None:
    with pytest.raises(LeakError) as info:
        leak_check(probe, lambda: probe.alloc(512), steps=1, warmup=0)
    assert info.value.result.per_step == [10_512]
    with pytest.raises(LeakError):
        leak_check(probe, lambda: probe.alloc(512), steps=2, warmup=0)
    assert not leak_check(probe, lambda: None, steps=1, warmup=0).leaked


def test_leak_check_confirms_with_garbage_collection(
    probe: FakeProbe, no_automatic_gc: None
) -> None:
    def step() -> None:
        garbage = Cycle(None)
        probe.alloc(512)
        weakref.finalize(garbage, probe.free, 512)

    result = leak_check(probe, step, steps=100, warmup=3)
    assert not result.leaked
    assert result.growth == 51_200  # what was seen step after step
    assert result.confirmed is not None
    assert result.confirmed <= 0  # nothing left once collected


def test_leak_check_growth_that_survives_collection_is_a_leak(
    probe: FakeProbe, no_automatic_gc: None
) -> None:
    def step() -> None:
        garbage = Cycle(None)
        probe.alloc(512)
        weakref.finalize(garbage, probe.free, 512)
        probe.alloc(64)  # and 64 bytes that no collection frees

    with pytest.raises(LeakError) as info:
        leak_check(probe, step, steps=100, warmup=0)
    assert info.value.result.confirmed == 6400


@pytest.mark.parametrize(
    ("steps", "warmup", "message"),
    [
        (0, 3, "steps must be a whole number >= 1, got 0 (int)"),
        (-1, 3, "steps must be a whole number >= 1, got -1 (int)"),
        (10, -1, "warmup must be a whole number >= 0, got -1 (int)"),
        (True, 3, "steps must be a whole number >= 1, got True (bool)"),
        (2.5, 3, "steps must be a whole number >= 1, got 2.5 (float)"),
        ("10", 3, "steps must be a whole number >= 1, got '10' (str)"),
        (10, 0.5, "warmup must be a whole number >= 0, got 0.5 (float)"),
    ],
)
def test_leak_check_validates_steps_and_warmup(
    probe: FakeProbe, steps: object, warmup: object, message: str
) -> None:
    step = Counter(lambda i: None)
    with pytest.raises(ValueError) as info:
        leak_check(probe, step, steps=steps, warmup=warmup)  # type: ignore[arg-type]
    assert str(info.value) == f"leak_check: {message}"
    assert step.calls == 0


@pytest.mark.parametrize("scenario", ["single_step", "leak_check"])
def test_a_step_that_is_not_a_function_is_named(probe: FakeProbe, scenario: str) -> None:
    run = single_step if scenario == "single_step" else leak_check
    with pytest.raises(ValueError) as info:
        run(probe, 42)  # type: ignore[arg-type]
    assert str(info.value) == (
        f"{scenario}: fn must be a function to call with no arguments (a step), got 42 (int)"
    )


def test_leak_check_without_warmup(probe: FakeProbe) -> None:
    step = Counter(lambda i: None)
    result = leak_check(probe, step, steps=5, warmup=0)
    assert step.calls == 5
    assert result.warmup == 0


def test_leak_check_result_to_dict(probe: FakeProbe) -> None:
    result = leak_check(probe, lambda: None, steps=3, warmup=1, tolerance="1KiB")
    assert result.to_dict() == {
        "per_step": [10_000, 10_000, 10_000],
        "growth": 0,
        "growth_per_step": 0.0,
        "sustained_per_step": 0.0,
        "steps": 3,
        "warmup": 1,
        "tolerance": "1KiB",
        "leaked": False,
    }


# -- leak_check on the cpu backend ----------------------------------------------------------


def test_cpu_leak_of_512_bytes_a_step_is_found(measurement: TestMeasurement) -> None:
    kept: list[torch.Tensor] = []
    with pytest.raises(LeakError) as info:
        leak_check(measurement, lambda: kept.append(torch.ones(TENSOR_512_BYTES)), tolerance="0B")
    result = info.value.result
    assert len(result.per_step) == 100
    assert result.baseline == 3 * 512
    assert result.per_step == [512 * (3 + i + 1) for i in range(100)]
    assert result.growth == 51_200
    assert result.confirmed == 51_200
    kept.clear()


def _training_step() -> Callable[[], None]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    inputs = torch.randn(8, 16)
    targets = torch.randn(8, 4)

    def step() -> None:
        loss = nn.functional.mse_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    return step


def test_cpu_training_step_is_not_a_leak(measurement: TestMeasurement) -> None:
    step = _training_step()
    result = leak_check(measurement, step, steps=100)
    assert not result.leaked
    assert result.growth == 0
    assert len(set(result.per_step)) == 1
    # Parameters, AdamW's two moments and step counters are held between steps.
    assert result.baseline > 0


def test_cpu_one_off_cache_is_not_a_leak(measurement: TestMeasurement) -> None:
    cache: dict[str, torch.Tensor] = {}

    def step(i: int) -> None:
        torch.ones(1024).sum()
        if i == 50:
            cache["table"] = torch.ones(4096)

    result = leak_check(measurement, Counter(step), steps=100)
    assert not result.leaked
    assert result.growth == 4096 * 4


def test_cpu_periodic_leak_is_found(measurement: TestMeasurement) -> None:
    kept: list[torch.Tensor] = []

    def step(i: int) -> None:
        if i % 3 == 0:
            kept.append(torch.ones(TENSOR_512_BYTES))

    with pytest.raises(LeakError) as info:
        leak_check(measurement, Counter(step), steps=100)
    assert info.value.result.growth == 33 * 512
    kept.clear()


def test_cpu_cyclic_garbage_is_not_a_leak(
    measurement: TestMeasurement, no_automatic_gc: None
) -> None:
    def step() -> None:
        Cycle(torch.ones(TENSOR_512_BYTES))

    result = leak_check(measurement, step, steps=100)
    assert not result.leaked
    assert result.growth == 51_200
    assert result.confirmed is not None
    assert result.confirmed <= 0
    assert parse_tolerance(0) == result.tolerance


def test_cpu_leak_error_result_per_step(measurement: TestMeasurement) -> None:
    kept: list[torch.Tensor] = []
    with pytest.raises(LeakError) as info:
        leak_check(measurement, lambda: kept.append(torch.ones(256)), steps=10, warmup=0)
    assert info.value.result.per_step == [1024 * (i + 1) for i in range(10)]
    assert info.value.result.to_dict()["per_step"] == info.value.result.per_step
    kept.clear()


# -- a failing step leaves nothing behind --------------------------------------------------

FAILING_STEPS = """
import torch

def test_step_raises_holding_a_closure(vram):
    held = None

    def step():
        nonlocal held
        held = torch.ones(10 * 2**20 // 4, device=vram.device)  # 10 MiB in a closure cell
        raise ValueError("the step failed")

    vram.single_step(step)

def test_step_raises_mid_expression(vram):
    vram.single_step(lambda: (torch.ones(10 * 2**20 // 4, device=vram.device), 1 / 0))

def test_leak_check_step_raises(vram):
    kept = []

    def step():
        kept.append(torch.ones(2**20 // 4, device=vram.device))
        if len(kept) == 5:
            raise RuntimeError("fifth step")

    vram.leak_check(step)

def test_after(vram):
    assert vram.allocated() == 0
    result = vram.single_step(lambda: torch.ones(2**20 // 4, device=vram.device))
    assert result.before == 0
    assert result.peak == 2**20
"""


# A pytest subprocess each (seconds): the cpu one runs by default.
@pytest.mark.parametrize("backend", ["cpu", pytest.param("sim", marks=pytest.mark.slow)])
def test_a_failed_step_leaves_nothing_to_later_tests(
    pytester: pytest.Pytester, backend: str
) -> None:
    pytester.makepyfile(FAILING_STEPS)
    # In a subprocess: in-process, pytester's hook recorder keeps every hook's arguments, the
    # failed call's traceback entries among them, as no plain pytest run does.
    # pytest-rerunfailures (a test extra here) keeps each failed call's ExceptionInfo on the
    # item, and with it what the traceback's frames held (docs/faults.md).
    result = pytester.runpytest_subprocess(
        f"--vram-backend={backend}", "--vram-report", "-p", "no:randomly", "-p", "no:rerunfailures"
    )
    result.assert_outcomes(passed=1, failed=3)
    result.stdout.fnmatch_lines(
        [
            f"*::test_step_raises_holding_a_closure * {backend} * 10.00 MiB * 10.00 MiB * 0 B *",
            f"*::test_step_raises_mid_expression * {backend} * 10.00 MiB * 10.00 MiB * 0 B *",
            f"*::test_leak_check_step_raises * {backend} * 5.00 MiB * 5.00 MiB * 0 B *",
            f"*::test_after * {backend} * 1.00 MiB * 1.00 MiB * 0 B * new",
        ]
    )


def test_the_vram_scenarios_name_an_argument_they_cannot_use(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_steps_true(vram):
            vram.leak_check(lambda: None, steps=True)

        def test_steps_fraction(vram):
            vram.leak_check(lambda: None, steps=2.5)

        def test_leak_fn(vram):
            vram.leak_check(42)

        def test_single_fn(vram):
            vram.single_step(42)
        """
    )
    result = pytester.runpytest("--vram-backend=cpu", "-p", "no:randomly")
    result.assert_outcomes(failed=4)
    result.stdout.fnmatch_lines(
        [
            "*UsageError: test_*.py::test_steps_true: vram.leak_check: steps must be a whole "
            "number >= 1, got True (bool)",
            "*UsageError: test_*.py::test_steps_fraction: vram.leak_check: steps must be a whole "
            "number >= 1, got 2.5 (float)",
            "*UsageError: test_*.py::test_leak_fn: vram.leak_check: fn must be a function to call "
            "with no arguments (a step), got 42 (int)",
            "*UsageError: test_*.py::test_single_fn: vram.single_step: fn must be a function to "
            "call with no arguments (a step), got 42 (int)",
        ],
        consecutive=False,
    )
    assert "TypeError" not in result.stdout.str()
