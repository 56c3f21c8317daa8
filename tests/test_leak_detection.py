"""leak_check on memory that stays within a bound and on memory that leaks, over many seeds.

The workloads drive a fake probe whose allocated bytes follow a random but seeded pattern, the
way steps with dynamic padding, caches and lazy buffers move a real allocator's count."""

from __future__ import annotations

import gc
import random
from collections.abc import Callable

import pytest
import torch

from pytest_vram.backends.cpu.backend import CpuBackend
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.measure.measurement import TestMeasurement
from pytest_vram.measure.scenarios import LeakError, leak_check

KiB = 1024
SEEDS = range(200)


@pytest.fixture
def no_collection(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fake workloads hold no garbage; a full collection would only cost time (~0.1 s)."""
    monkeypatch.setattr(gc, "collect", lambda generation=2: 0)


class Workload:
    """A step and the bytes it leaves allocated: a fixed base plus whatever ``parts`` hold."""

    def __init__(self, base: int = 1_000_000) -> None:
        self.base = base
        self.parts: dict[str, int] = {}
        self.calls = 0
        self.moves: list[Callable[[Workload], None]] = []

    def __call__(self) -> None:
        self.calls += 1
        for move in self.moves:
            move(self)

    # the probe
    def allocated(self) -> int:
        return self.base + sum(self.parts.values())

    def reset_peak(self) -> None:
        pass

    def peak(self) -> int:
        return self.allocated()

    def release_cache(self) -> None:
        pass


def random_tensor(rng: random.Random, high: int, granule: int = 1) -> Callable[[Workload], None]:
    """One tensor of random size replaced every step (dynamic padding, a short last batch)."""

    def move(w: Workload) -> None:
        w.parts["batch"] = rng.randint(0, high // granule) * granule

    return move


def periodic_cache(rng: random.Random, period: int, entry: int) -> Callable[[Workload], None]:
    """A cache that gains an entry every step and is cleared every ``period`` steps."""

    def move(w: Workload) -> None:
        if w.calls % period == 0:
            w.parts["cache"] = 0
        else:
            w.parts["cache"] = w.parts.get("cache", 0) + rng.randint(1, entry)

    return move


def one_off(at: int, nbytes: int) -> Callable[[Workload], None]:
    """A buffer created once, lazily, and kept."""

    def move(w: Workload) -> None:
        if w.calls == at:
            w.parts["buffer"] = nbytes

    return move


def leak(per_step: int, every: int = 1, start: int = 1) -> Callable[[Workload], None]:
    """``per_step`` bytes kept every ``every`` calls from call ``start`` on."""

    def move(w: Workload) -> None:
        if w.calls >= start and w.calls % every == 0:
            w.parts["leak"] = w.parts.get("leak", 0) + per_step

    return move


def bounded(kind: str, seed: int) -> Workload:
    rng = random.Random(f"{kind}-{seed}")
    w = Workload()
    if kind == "random size":
        w.moves.append(random_tensor(rng, 64 * KiB))
    elif kind == "padded size":  # a few distinct sizes: many ties in the floor
        w.moves.append(random_tensor(rng, 4 * KiB, granule=512))
    elif kind == "periodic cache":
        w.moves.append(periodic_cache(rng, rng.randint(2, 50), 4 * KiB))
    elif kind == "one-off":
        w.moves.append(one_off(rng.randint(1, 250), rng.randint(1, 4 * 2**20)))
    elif kind == "all of them":
        w.moves += [
            random_tensor(rng, 32 * KiB),
            periodic_cache(rng, rng.randint(2, 30), 2 * KiB),
            one_off(rng.randint(1, 250), rng.randint(1, 2**20)),
            one_off(rng.randint(1, 250), rng.randint(1, 2**20)),
        ]
    return w


@pytest.mark.parametrize(
    "kind", ["random size", "padded size", "periodic cache", "one-off", "all of them"]
)
def test_bounded_memory_is_never_a_leak(kind: str, no_collection: None) -> None:
    false_alarms = []
    for seed in SEEDS:
        w = bounded(kind, seed)
        try:
            leak_check(w, w, steps=100, warmup=3)
        except LeakError as exc:
            false_alarms.append((seed, str(exc)))
    assert false_alarms == []


def leaking(kind: str, seed: int) -> Workload:
    rng = random.Random(f"{kind}-{seed}")
    w = Workload()
    if kind == "steady":
        w.moves.append(leak(512))
    elif kind == "every 3 steps":
        w.moves.append(leak(1536, every=3))
    elif kind == "every 10 steps":
        w.moves.append(leak(5120, every=10))
    elif kind == "from step 60":
        w.moves.append(leak(512, start=3 + 60))  # calls count the 3 warm-up steps
    elif kind == "inside random sizes":
        w.moves += [random_tensor(rng, 48 * KiB), leak(512)]
    elif kind == "inside a cache and random sizes":
        w.moves += [
            random_tensor(rng, 32 * KiB),
            periodic_cache(rng, rng.randint(2, 20), 2 * KiB),
            leak(512),
        ]
    return w


@pytest.mark.parametrize(
    "kind",
    [
        "steady",
        "every 3 steps",
        "every 10 steps",
        "from step 60",
        "inside random sizes",
        "inside a cache and random sizes",
    ],
)
def test_leak_is_always_found(kind: str, no_collection: None) -> None:
    missed = []
    for seed in range(50):
        w = leaking(kind, seed)
        with pytest.raises(LeakError) as info:
            leak_check(w, w, steps=100, warmup=3)
        result = info.value.result
        if not result.leaked:
            missed.append(seed)
        assert len(result.per_step) == 100
        # The floor's rate is the leak's, whatever the noise around it.
        assert result.sustained_per_step == pytest.approx(512, rel=0.35)
    assert missed == []


def test_bounded_random_sizes_are_measured_as_they_were() -> None:
    w = bounded("random size", seed=7)
    result = leak_check(w, w, steps=100, warmup=3)
    assert len(result.per_step) == 100
    assert result.growth == result.per_step[-1] - result.baseline
    assert result.growth_per_step == result.growth / 100
    assert not result.leaked


def test_tolerance_allows_sustained_growth_below_it(no_collection: None) -> None:
    # 512 bytes a step inside random sizes: about 50 KiB over 100 steps.
    for seed in range(20):
        w = leaking("inside random sizes", seed)
        assert not leak_check(w, w, steps=100, tolerance="80KiB").leaked
        w = leaking("inside random sizes", seed)
        with pytest.raises(LeakError, match="tolerance 20KiB"):
            leak_check(w, w, steps=100, tolerance="20KiB")


def test_confirmation_steps_run_only_when_a_leak_is_suspected() -> None:
    w = Workload()
    w.moves.append(lambda w: None)
    result = leak_check(w, w, steps=100, warmup=3)
    assert w.calls == 103
    assert result.confirmation == []

    w = leaking("steady", 0)
    with pytest.raises(LeakError) as info:
        leak_check(w, w, steps=100, warmup=3)
    confirmation = info.value.result.confirmation
    assert w.calls == 103 + len(confirmation)
    assert confirmation == [w.base + 512 * (103 + i + 1) for i in range(len(confirmation))]
    assert "kept rising over 100 more steps" in str(info.value)


# -- real allocations -------------------------------------------------------------------------


@pytest.fixture(params=["cpu", "sim"])
def measurement(request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
    backend = CpuBackend() if request.param == "cpu" else SimBackend()
    m = TestMeasurement(backend, "tests/test_leak_detection.py::test_x")
    m.begin()
    try:
        yield m
    finally:
        m.end()
        backend.close()


def _device(measurement: TestMeasurement) -> torch.device:
    return measurement.backend.device


def test_random_padding_on_a_real_backend_is_not_a_leak(measurement: TestMeasurement) -> None:
    device = _device(measurement)
    for seed in range(20):
        rng = random.Random(seed)
        held: dict[str, torch.Tensor] = {}

        def step(rng: random.Random = rng, held: dict[str, torch.Tensor] = held) -> None:
            # The last batch of an epoch, or a batch padded to its longest sequence.
            held["batch"] = torch.ones(rng.randint(1, 16) * 32, device=device)

        result = leak_check(measurement, step, steps=100)
        assert not result.leaked, seed
        held.clear()


def test_leak_inside_random_padding_on_a_real_backend_is_found(
    measurement: TestMeasurement,
) -> None:
    device = _device(measurement)
    rng = random.Random(0)
    held: dict[str, torch.Tensor] = {}
    kept: list[torch.Tensor] = []

    def step() -> None:
        held["batch"] = torch.ones(rng.randint(1, 8 * KiB), device=device)  # up to 32 KiB
        kept.append(torch.ones(128, device=device))  # 512 bytes, never freed

    with pytest.raises(LeakError) as info:
        leak_check(measurement, step, steps=100)
    assert info.value.result.sustained_per_step == pytest.approx(512, rel=0.35)
    held.clear()
    kept.clear()
