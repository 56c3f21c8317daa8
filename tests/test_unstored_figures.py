"""Figures a backend reads from the whole device (cuda's reserved and NVML figures) depend on
what other tests hold: they are reported, never stored in a baseline."""

from __future__ import annotations

import torch

from pytest_vram.backends.cpu.backend import CpuBackend
from pytest_vram.backends.cuda.backend import CudaBackend
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.measure.measurement import TestMeasurement
from pytest_vram.record.record import TestRecord


def test_cuda_reads_reserved_and_device_memory_from_the_whole_device() -> None:
    assert CudaBackend.order_dependent_figures == {"peak_reserved", "peak_device"}
    # The sim replays each test's own segments; cpu has no reserved figure.
    assert SimBackend.order_dependent_figures == frozenset()
    assert CpuBackend.order_dependent_figures == frozenset()


def test_an_unstored_figure_is_reported_but_not_in_the_baseline_entry() -> None:
    record = TestRecord(
        "test_a.py::test_a",
        "cuda",
        "NVIDIA H200",
        peak_allocated=1024,
        peak_reserved=2 * 1024**2,
        peak_device=600 * 1024**2,
        unstored=["peak_device", "peak_reserved"],
    )
    assert record.figures() == {"peak_allocated": 1024}
    data = record.to_dict()
    assert data["peak_reserved"] == 2 * 1024**2 and data["peak_device"] == 600 * 1024**2
    # It travels to an xdist controller, or into a shard, and is still not stored there.
    assert TestRecord.from_dict(data).figures() == {"peak_allocated": 1024}


def test_a_record_without_unstored_figures_reads_as_before() -> None:
    record = TestRecord("t.py::t", "sim", "sim", peak_allocated=1, peak_reserved=2)
    assert "unstored" not in record.to_dict()
    assert record.figures() == {"peak_allocated": 1, "peak_reserved": 2}


class _WholeDeviceCpu(CpuBackend):
    """The cpu backend, declaring its reserved figure order-dependent as cuda's is."""

    order_dependent_figures = frozenset({"peak_reserved"})

    def reserved(self) -> int:
        return 4096

    def peak_reserved(self) -> int:
        return 8192


def test_the_measurement_marks_what_its_backend_cannot_store() -> None:
    backend = _WholeDeviceCpu()
    try:
        measurement = TestMeasurement(backend, "t.py::t")
        measurement.begin()
        kept = torch.ones(256)
        measurement.finish_call()
        measurement.end()
    finally:
        backend.close()
    record = measurement.record
    assert record.peak_reserved == 8192
    assert record.unstored == ["peak_reserved"]
    assert "peak_reserved" not in record.figures()
    assert record.figures()["peak_allocated"] >= kept.nbytes
