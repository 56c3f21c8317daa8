"""A test's figures read across setup, call and teardown, on the cpu backend."""

from __future__ import annotations

import gc
import sys
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

import pytest_vram.garbage as garbage_module
from pytest_vram.backends.cpu.backend import CpuBackend
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.measure.handle import VramHandle
from pytest_vram.measure.measurement import TestMeasurement
from pytest_vram.measure.scenarios import single_step

KiB = 1024


def floats(nbytes: int) -> torch.Tensor:
    """A float32 tensor of exactly ``nbytes`` bytes."""
    return torch.ones(nbytes // 4)


class Cycle:
    def __init__(self, value: Any) -> None:
        self.me = self
        self.value = value


@pytest.fixture
def backend() -> Iterator[CpuBackend]:
    backend = CpuBackend()
    try:
        yield backend
    finally:
        backend.close()  # whatever a failing test left open


@pytest.fixture
def gc_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The generations of the collections the measurement makes (a full one, 2, costs tens of
    milliseconds)."""
    calls: list[int] = []

    def collect(generation: int = 2) -> int:
        calls.append(generation)
        return gc.collect(generation)

    monkeypatch.setattr(garbage_module, "gc", SimpleNamespace(collect=collect))
    return calls


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def test_record_names_the_test_and_backend(backend: CpuBackend) -> None:
    m = TestMeasurement(backend, "tests/test_a.py::test_b[1]")
    assert m.record.nodeid == "tests/test_a.py::test_b[1]"
    assert m.record.backend == "cpu"
    assert m.record.device == "cpu"


def test_lifecycle_figures(backend: CpuBackend) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    fixture = floats(2 * KiB)  # setup: a fixture's tensor
    scratch = floats(8 * KiB)  # setup: a temporary
    del scratch
    result = floats(4 * KiB)  # call
    temporary = floats(1 * KiB)
    del temporary
    m.finish_call()
    teardown_spike = floats(64 * KiB)  # teardown does not count towards the peak
    del teardown_spike, fixture
    m.end()

    record = m.record
    assert record.start_allocated == 0
    assert record.peak_allocated == 10 * KiB  # fixture + setup temporary
    assert record.peak_increment == 10 * KiB
    assert record.end_allocated == 4 * KiB  # `result` is still alive
    assert record.leftover == 4 * KiB
    assert record.counters == {}
    assert record.peak_reserved is None
    assert record.peak_device is None
    del result


def test_peak_of_the_call_when_it_is_the_largest(backend: CpuBackend) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    fixture = floats(2 * KiB)
    big = floats(16 * KiB)
    del big
    m.finish_call()
    del fixture
    m.end()
    assert m.record.peak_allocated == 18 * KiB
    assert m.record.end_allocated == 0
    assert m.record.leftover == 0


def test_start_includes_what_earlier_tests_left_alive(backend: CpuBackend) -> None:
    first = TestMeasurement(backend, "t.py::test_first")
    first.begin()
    module_fixture = floats(3 * KiB)
    first.end()
    assert first.record.end_allocated == 3 * KiB

    second = TestMeasurement(backend, "t.py::test_second")
    second.begin()
    spike = floats(1 * KiB)
    del spike
    second.end()
    assert second.record.start_allocated == 3 * KiB
    assert second.record.peak_allocated == 4 * KiB  # absolute: includes the fixture
    assert second.record.peak_increment == 1 * KiB
    assert second.record.end_allocated == 3 * KiB
    assert second.record.leftover == 0
    del module_fixture


def test_end_without_finish_call_freezes_the_peak(backend: CpuBackend) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    spike = floats(4 * KiB)
    del spike
    m.end()
    assert m.record.peak_allocated == 4 * KiB
    assert m.record.end_allocated == 0


def test_nothing_is_counted_after_end_and_pause(backend: CpuBackend) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    m.end()
    backend.pause()
    after = floats(4 * KiB)
    assert backend.allocated() == 0
    del after


def test_nested_windows_keep_their_own_peaks(backend: CpuBackend) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    held = floats(1 * KiB)
    outer = m.open_window()
    spike = floats(8 * KiB)
    del spike
    inner = m.open_window()  # resets the backend's peak
    assert m.peak() == 1 * KiB
    small = floats(2 * KiB)
    del small
    m.close_window(inner)
    m.close_window(outer)
    del held
    m.end()

    assert inner.allocated == 3 * KiB
    assert outer.allocated == 9 * KiB
    assert m.record.peak_allocated == 9 * KiB


def test_single_step_inside_a_test_does_not_lose_the_test_peak(backend: CpuBackend) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    spike = floats(32 * KiB)
    del spike
    step = single_step(m, lambda: floats(4 * KiB).sum().item())
    m.end()

    assert step.peak == 4 * KiB + 4  # the step's own peak: the tensor and its sum
    assert m.record.peak_allocated == 32 * KiB  # the test's peak survives the step's reset


@pytest.fixture(params=["cpu", "sim"])
def handle(request: pytest.FixtureRequest) -> Iterator[VramHandle]:
    backend = CpuBackend() if request.param == "cpu" else SimBackend()
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    try:
        yield VramHandle(m)
    finally:
        m.end()
        backend.close()


def test_single_step_keeps_its_peak_from_before_a_measure_block_inside_it(
    handle: VramHandle,
) -> None:
    def step() -> None:
        activations = torch.ones(2 * 2**20, device=handle.device)  # 8 MiB
        del activations
        with handle.measure() as inner:  # resets the backend's peak
            scratch = torch.ones(2**18, device=handle.device)  # 1 MiB
            del scratch
        assert inner.peak == 1 * 2**20

    result = handle.single_step(step)
    assert result.peak == 8 * 2**20
    assert result.delta == 8 * 2**20
    # What the baseline stores is the step's real peak.
    assert handle._measurement.record.scenarios["single_step"]["peak"] == 8 * 2**20


def test_measure_block_keeps_its_peak_from_before_a_single_step_inside_it(
    handle: VramHandle,
) -> None:
    with handle.measure() as outer:
        spike = torch.ones(2 * 2**20, device=handle.device)  # 8 MiB
        del spike

        def step() -> None:
            torch.ones(2**18, device=handle.device)  # 1 MiB, freed at once

        result = handle.single_step(step)
        held = torch.ones(2**19, device=handle.device)  # 2 MiB after the step
    assert result.peak == 1 * 2**20  # the step's own
    assert outer.peak == 8 * 2**20
    assert outer.end == 2 * 2**20
    del held


def test_single_step_that_raises_closes_its_window(handle: VramHandle) -> None:
    def step() -> None:
        torch.ones(2**18, device=handle.device)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        handle.single_step(step)
    # Only the test's own window stays open.
    assert len(handle._measurement._windows) == 1


def test_reset_peak_folds_into_every_open_window(backend: CpuBackend) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    outer = m.open_window()
    spike = floats(8 * KiB)
    del spike
    m.reset_peak()
    m.reset_peak()
    assert m.peak() == 0
    m.close_window(outer)
    assert outer.allocated == 8 * KiB
    m.end()


def test_no_collection_when_nothing_is_left(backend: CpuBackend, gc_calls: list[int]) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    temporary = floats(4 * KiB)
    del temporary
    m.end()
    assert gc_calls == []
    assert m.record.end_allocated == 0


def test_collection_frees_a_reference_cycle_left_by_the_test(
    backend: CpuBackend, gc_calls: list[int], no_automatic_gc: None
) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    Cycle(floats(4 * KiB))  # garbage only the cycle collector frees
    assert backend.allocated() == 4 * KiB
    m.end()
    assert gc_calls == [1]  # the young generations free it: no full collection
    assert m.record.end_allocated == 0
    assert m.record.leftover == 0
    assert m.record.peak_allocated == 4 * KiB


def test_a_cycle_that_aged_into_the_oldest_generation_is_collected(
    backend: CpuBackend, gc_calls: list[int], no_automatic_gc: None
) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    holder = [Cycle(floats(4 * KiB))]
    gc.collect(1)  # survives twice: in the oldest generation now
    gc.collect(1)
    gc_calls.clear()
    holder.clear()  # garbage, where the young collection does not look
    m.end()
    assert gc_calls == [1, 2]
    assert m.record.end_allocated == 0


def test_a_real_leftover_survives_collection(
    backend: CpuBackend, gc_calls: list[int], no_automatic_gc: None
) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    kept = floats(1 * KiB)
    Cycle(floats(4 * KiB))
    m.end()
    assert gc_calls == [1, 2]  # what the young generations leave, a full collection keeps
    assert m.record.end_allocated == 1 * KiB
    assert m.record.leftover == 1 * KiB
    del kept


@pytest.fixture
def old_garbage() -> Iterator[garbage_module.OldGarbage]:
    old = garbage_module.OldGarbage()
    old.watch()
    try:
        yield old
    finally:
        old.unwatch()


@pytest.mark.skipif(not garbage_module._GENERATIONAL, reason="a generational collector")
def test_after_a_full_collection_only_a_let_go_makes_the_next_one_full(
    backend: CpuBackend, old_garbage: garbage_module.OldGarbage, no_automatic_gc: None
) -> None:
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    old_garbage.collect_all()
    assert not old_garbage.possible
    holder = [Cycle(floats(4 * KiB))]
    old_garbage.collect_young()  # what a test's end does: it survives into the oldest
    old_garbage.collect_young()
    assert not old_garbage.possible
    holder.clear()  # garbage where only a full collection looks, let go without a word
    assert garbage_module.collect_garbage(backend, 0, old_garbage) == 4 * KiB
    old_garbage.let_go()  # a broader-scoped fixture's finaliser, or a failed test's exception
    assert garbage_module.collect_garbage(backend, 0, old_garbage) == 0
    assert not old_garbage.possible
    m.end()


@pytest.mark.skipif(not garbage_module._GENERATIONAL, reason="a generational collector")
def test_an_automatic_collection_of_generation_1_makes_the_next_one_full(
    old_garbage: garbage_module.OldGarbage,
) -> None:
    old_garbage.collect_all()
    assert not old_garbage.possible
    gc.collect(0)  # the young one stays young
    assert not old_garbage.possible
    gc.collect(1)  # not the plugin's: a busy test's objects may have aged
    assert old_garbage.possible


@pytest.mark.skipif(not garbage_module._GENERATIONAL, reason="a generational collector")
def test_what_an_automatic_full_collection_saw_alive_is_collected_after_the_test(
    backend: CpuBackend, old_garbage: garbage_module.OldGarbage, no_automatic_gc: None
) -> None:
    # A test's model, alive when Python collected every generation on its own in the middle
    # of the test, is in the oldest generation when the test ends. Left there, the next
    # automatic full collection frees it in the middle of a later test, whose figures drop.
    m = TestMeasurement(backend, "t.py::test")
    m.begin()
    old_garbage.collect_all()
    model = [Cycle(floats(4 * KiB))]
    gc.collect()  # not the plugin's: an automatic collection of the oldest generation
    model.clear()  # the test ends: garbage where only a full collection looks
    assert backend.allocated() == 4 * KiB
    assert garbage_module.collect_garbage(backend, 0, old_garbage) == 0
    m.end()


def test_a_full_collection_after_an_import_freezes_what_survives_it(
    old_garbage: garbage_module.OldGarbage, monkeypatch: pytest.MonkeyPatch
) -> None:
    frozen = gc.get_freeze_count()
    kept = [[] for _ in range(1000)]  # tracked by the collector, as objects() are not
    garbage = Cycle(None)
    del garbage
    old_garbage.collect_all()  # no module was imported: nothing more is frozen
    assert gc.get_freeze_count() == frozen
    monkeypatch.setitem(sys.modules, "imported_during_a_test", types.ModuleType("x"))
    found = []
    gc.callbacks.append(lambda phase, info: found.append(info.get("collected", 0)))
    try:
        garbage = Cycle(None)
        del garbage
        old_garbage.collect_all()
    finally:
        gc.callbacks.pop()
    assert sum(found) >= 1  # the cycle was collected, not frozen
    refrozen = gc.get_freeze_count()
    assert refrozen >= frozen + len(kept)
    more = [[] for _ in range(1000)]
    old_garbage.collect_all()  # until the next import, nothing more
    assert gc.get_freeze_count() == refrozen
    old_garbage.unwatch()  # the session's end gives every frozen object back
    assert gc.get_freeze_count() == 0
    del kept, more


def test_a_fixture_frozen_by_a_full_collection_is_thawed_when_it_ends(
    old_garbage: garbage_module.OldGarbage, monkeypatch: pytest.MonkeyPatch
) -> None:
    made_at = old_garbage.freezes
    fixture_value = [Cycle(None)]  # alive at the full collection after an import
    monkeypatch.setitem(sys.modules, "imported_during_a_test", types.ModuleType("x"))
    old_garbage.collect_all()
    assert gc.get_freeze_count() > 0
    old_garbage.let_go()  # a failed test's exception: its objects were never frozen
    old_garbage.let_go(made_at=old_garbage.freezes)  # a fixture made since: not frozen
    assert gc.get_freeze_count() > 0
    fixture_value.clear()  # the fixture ends: its cycle is frozen garbage
    old_garbage.let_go(made_at=made_at)
    assert gc.get_freeze_count() == 0
    found = []
    gc.callbacks.append(lambda phase, info: found.append(info.get("collected", 0)))
    try:
        old_garbage.collect_all()  # frees the cycle, and freezes the rest again
    finally:
        gc.callbacks.pop()
    assert sum(found) >= 1
    refrozen = gc.get_freeze_count()
    assert refrozen > 0
    old_garbage.let_go(made_at=made_at)  # that freeze was no import's: nothing to thaw
    assert gc.get_freeze_count() == refrozen
