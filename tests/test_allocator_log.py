"""The cpu allocator counter's log: what a breakdown of the peak reads on the cpu backend."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pytest_vram.attribution.breakdown import PeakBreakdown
from pytest_vram.backends.cpu import build as cpu_build
from pytest_vram.backends.cpu.backend import CpuBackend
from pytest_vram.backends.tracker import making_fixture


def _backend(counter: str) -> CpuBackend:
    if counter == "allocator" and cpu_build.find_compiler() is None:
        pytest.skip("no C++ compiler to build the counter")
    backend = CpuBackend(counter)
    backend.begin_test()
    return backend


@pytest.fixture
def cpu() -> Iterator[CpuBackend]:
    backend = _backend("allocator")
    try:
        yield backend
    finally:
        backend.close()


def _source(backend: CpuBackend) -> Any:
    return backend.tracker if backend.tracker is not None else backend.allocation_log()


def _step() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256)
    )
    optimizer = torch.optim.AdamW(model.parameters())
    batch = torch.randn(512, 256)
    for _ in range(2):
        model(batch).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def _breakdown_of_a_step(counter: str) -> dict[str, Any]:
    backend = _backend(counter)
    try:
        breakdown = PeakBreakdown(_source(backend))
        backend.reset_peak()
        start = backend.allocated()
        breakdown.start()
        try:
            _step()
            return breakdown.result(backend.peak_allocated() - start)
        finally:
            breakdown.stop()
    finally:
        backend.close()


def test_the_logs_breakdown_is_the_dispatch_trackers() -> None:
    # The same step, broken down from the log inside the allocator and from a dispatch mode
    # that sees every op's outputs: the same categories and modules.
    logged = _breakdown_of_a_step("allocator")
    dispatched = _breakdown_of_a_step("dispatch")
    categories = logged["categories"]
    assert categories["parameters"] == 4 * (2 * 256 * 1024 + 1024 + 256)
    assert categories["optimizer"] >= 2 * categories["parameters"]
    assert categories["activations"] > 0
    for name in ("parameters", "gradients", "optimizer", "activations"):
        assert categories[name] == dispatched["categories"][name], name
    names = [module["name"] for module in logged["modules"]]
    assert names == [module["name"] for module in dispatched["modules"]]
    assert {"Sequential.0", "Sequential.2"} <= set(names)


def test_blocks_from_before_the_log_are_adopted_when_met(cpu: CpuBackend) -> None:
    model = torch.nn.Linear(512, 512)  # counted, but allocated before the log began
    breakdown = PeakBreakdown(cpu.allocation_log(), modules=False)
    breakdown.start()
    try:
        model(torch.randn(8, 512)).sum().backward()
        result = breakdown.result()
    finally:
        breakdown.stop()
    parameters = 4 * (512 * 512 + 512)
    assert result["categories"]["parameters"] == parameters
    # The weight's gradient is at the peak; the bias's may come after it.
    assert 4 * 512 * 512 <= result["categories"]["gradients"] <= parameters


def test_what_a_fixture_makes_is_held_not_the_tests(cpu: CpuBackend) -> None:
    breakdown = PeakBreakdown(cpu.allocation_log(), modules=False)
    breakdown.start()
    try:
        making_fixture(True)
        held = torch.ones(4096)
        making_fixture(False)
        with torch.no_grad():
            temporary = torch.ones(1024) * 2
        result = breakdown.result()
    finally:
        breakdown.stop()
    assert result["categories"]["other"] == held.nbytes
    assert result["categories"]["temporaries"] >= temporary.nbytes


def test_frees_on_other_threads_reach_the_log_in_order(cpu: CpuBackend) -> None:
    log = cpu.allocation_log()
    breakdown = PeakBreakdown(log, modules=False)
    breakdown.start()
    try:
        first = [torch.ones(8192)]
        freeing = threading.Thread(target=first.clear)
        freeing.start()
        freeing.join()
        second = torch.ones(4096)
        result = breakdown.result()
    finally:
        breakdown.stop()
    # Had the free been lost, both would be live at the end: 48 KiB, not the 32 KiB of the first.
    assert result["total"] == 8192 * 4
    assert second.nbytes == 4096 * 4


def test_nothing_is_logged_after_the_breakdown_stops(cpu: CpuBackend) -> None:
    breakdown = PeakBreakdown(cpu.allocation_log(), modules=False)
    breakdown.start()
    kept = [torch.ones(16) for _ in range(10)]
    breakdown.stop()
    logged = cpu.counter.log_length()
    assert logged >= 10
    del kept
    more = torch.ones(16)
    assert cpu.counter.log_length() == logged
    assert more.nbytes == 64


def test_a_long_log_is_let_go_when_the_breakdown_stops(cpu: CpuBackend) -> None:
    breakdown = PeakBreakdown(cpu.allocation_log(), modules=False)
    breakdown.start()
    for _ in range(40_000):  # two events each: more than a stopped log keeps
        torch.ones(1)
    assert cpu.counter.log_length() == 80_000
    breakdown.stop()
    assert cpu.counter.log_length() == 0


def test_a_new_breakdown_starts_on_an_empty_log(cpu: CpuBackend) -> None:
    log = cpu.allocation_log()
    first = PeakBreakdown(log, modules=False)
    first.start()
    big = torch.ones(1 << 16)
    first.stop()
    del big
    second = PeakBreakdown(log, modules=False)
    second.start()
    try:
        assert cpu.counter.log_length() == 0
        small = torch.ones(256)
        result = second.result()
    finally:
        second.stop()
    # The first breakdown's block and its free are not the second's peak.
    assert result["total"] == small.nbytes
    assert result["categories"]["temporaries"] == small.nbytes


def test_every_block_alive_at_a_peak_of_many_is_read(cpu: CpuBackend) -> None:
    # More blocks alive at the peak than the buffer kept for reading them holds.
    breakdown = PeakBreakdown(cpu.allocation_log(), modules=False)
    breakdown.start()
    try:
        blocks = [torch.ones(64) for _ in range(1000)]
        peak = sum(block.untyped_storage().nbytes() for block in blocks)
        blocks.clear()
        after = torch.ones(64)
        result = breakdown.result()
    finally:
        breakdown.stop()
    assert result["total"] == peak
    assert result["categories"]["temporaries"] == peak
    assert after.nbytes == 256


def _by_place(live: Any) -> dict[Any, int]:
    totals: dict[Any, int] = {}
    for _tag, size, place in live:
        totals[place] = totals.get(place, 0) + size
    return {place: size for place, size in totals.items() if size}


def test_the_peak_by_place_kept_as_the_log_grows_is_the_replays(cpu: CpuBackend) -> None:
    # What a test whose tensors no hook met reads in place equals the replay of its log.
    log = cpu.allocation_log()
    log.add_listener(object())
    try:
        log.note_place("a")
        first = torch.ones(256)
        log.note_place("b")
        second = torch.ones(1024)
        del first
        third = torch.ones(2048)  # the peak: second and third
        del third
        log.note_place("a")
        fourth = torch.ones(512)
        expected = {"b": second.nbytes + 2048 * 4}
        assert _by_place(log.live_at_peak(by_place=True)) == expected
        assert _by_place(log.live_at_peak()) == expected
        log.peak_from_here()  # what came before was a fixture's: only the next peak counts
        fifth = torch.ones(128)
        expected = {"b": second.nbytes, "a": fourth.nbytes + fifth.nbytes}
        assert _by_place(log.live_at_peak(by_place=True)) == expected
        assert _by_place(log.live_at_peak()) == expected
    finally:
        log.remove_listener(None)


def test_more_places_than_kept_in_place_are_replayed(cpu: CpuBackend) -> None:
    log = cpu.allocation_log()
    log.add_listener(object())
    try:
        kept = []
        for place in range(40):
            log.note_place(("place", place))
            kept.append(torch.ones(64 * (place + 1)))
        by_place = _by_place(log.live_at_peak(by_place=True))
    finally:
        log.remove_listener(None)
    assert by_place == {("place", n): kept[n].nbytes for n in range(40)}
