"""A backend is known by the abilities it declares (``backends/base.py``), never by its name:
a new backend that declares what the cpu, cuda or simulated one has is treated as they are."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pytest_vram.attribution.leaks import record_leak_sites
from pytest_vram.backends.base import Backend
from pytest_vram.backends.cpu.backend import CpuBackend
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.fit.trials import PeakTrials, SimTrials, trials_for
from pytest_vram.measure.ownership import OwnView
from pytest_vram.wiring.snapshots import SnapshotError, SnapshotRecorder


class Plain(Backend):
    """A backend that declares nothing beyond the figures."""

    name = "plain"
    device = torch.device("cpu")

    def allocated(self) -> int:
        return 0

    def peak_allocated(self) -> int:
        return 0

    def reset_peak(self) -> None:
        pass


class Probe:
    """What a leak check hands attribution: something with the test's backend."""

    def __init__(self, backend: object) -> None:
        self.backend = backend


def test_a_backend_without_abilities_gets_the_defaults() -> None:
    backend = Plain()
    assert backend.tracker is None
    assert backend.attribution_filter is None
    assert backend.segments is None and backend.own_segments is None
    assert not backend.is_cuda_device and not backend.memory_history
    assert backend.computing
    assert backend.snapshot_note is None
    assert backend.unmeasured == {}
    assert backend.device_backend is backend
    backend.use_values(True, "a reason", guess=True)  # nothing to change
    assert backend.own_reserved() is None and backend.own_peak_reserved() is None
    assert record_leak_sites(Probe(backend)) is None
    assert type(trials_for(backend)) is PeakTrials


def test_the_cpu_counters_declare_where_attribution_sees_allocations() -> None:
    dispatch = CpuBackend("dispatch")
    assert dispatch.tracker is dispatch.counter.tracker
    assert dispatch.attribution_filter is not None


class Renamed(CpuBackend):
    name = "renamed"


def test_leak_sites_are_recorded_on_any_backend_that_sees_allocations() -> None:
    backend = Renamed("dispatch")
    recorder = record_leak_sites(Probe(OwnView(backend, 0)))
    assert recorder is not None
    kept = []
    backend.begin_test()
    try:
        with recorder:
            for _ in range(3):
                recorder.next_step()
                kept.append(torch.ones(1024))
    finally:
        backend.close()
    (site,) = recorder.sites
    assert site.site[2] == "test_leak_sites_are_recorded_on_any_backend_that_sees_allocations"
    assert (site.bytes, site.count) == (2 * 4096, 2)  # the last step's own is not a leak


class RenamedSim(SimBackend):
    name = "simulated"


def test_max_size_caps_the_own_segments_of_any_backend_that_lays_them_out() -> None:
    backend = RenamedSim()
    trials = trials_for(OwnView(backend, 0))
    assert type(trials) is SimTrials
    assert trials.backend is backend  # the device itself, not the test's view of it


class NoHistory(Plain):
    memory_history = True

    @property
    def snapshot_note(self) -> str | None:
        return "the allocator records no history here"


def test_a_snapshot_says_why_the_allocator_keeps_no_history(tmp_path: Path) -> None:
    backend = NoHistory()
    recorder = SnapshotRecorder(tmp_path)
    recorder.start(OwnView(backend, 0))
    with pytest.raises(SnapshotError) as failure:
        recorder.dump(backend, "test_x.py::test_x")
    assert str(failure.value) == (
        "no memory snapshot of test_x.py::test_x: the allocator records no history here"
    )
    assert list(tmp_path.iterdir()) == []
