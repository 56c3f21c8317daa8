"""The cuda backend and the NVML sampler against a fake torch.cuda and a fake pynvml.

Every test here replaces torch.cuda's memory functions with a small allocator model, so they
run without a GPU and check what the backend reads, resets and calls.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pytest_vram.backends import nvml
from pytest_vram.backends.base import BackendUnavailable
from pytest_vram.backends.cuda import CudaBackend
from pytest_vram.measurement import TestMeasurement

GiB = 1024**3
MiB = 1024**2
H100 = "NVIDIA H100 80GB HBM3"
UUID = "8f2c4d1e-0b6a-4c5e-9d7f-2a1b3c4d5e6f"
SEGMENT = 2 * MiB


class FakeAllocator:
    """The caching allocator's figures: blocks come from 2 MiB segments it keeps until emptied."""

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.num_ooms = 0
        self.num_alloc_retries = 0
        self.inactive_split = 0
        self.initialised = False
        self.calls: list[str] = []
        self.devices: set[int] = set()

    def malloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        if self.allocated > self.reserved:
            self.reserved = -(-self.allocated // SEGMENT) * SEGMENT
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = -(-self.allocated // SEGMENT) * SEGMENT

    def seen(self, device: Any) -> int:
        index = 0 if device is None else int(device)
        self.devices.add(index)
        return index


class FakeNvml(types.ModuleType):
    """pynvml with one GPU whose used memory the test sets."""

    def __init__(self, used: int = 1 * GiB, total: int = 80 * GiB) -> None:
        super().__init__("pynvml")
        self.used = used
        self.total = total
        self.init_error: Exception | None = None
        self.uuid_error: Exception | None = None
        self.read_error: Exception | None = None
        self.handles: list[tuple[str, object]] = []
        self.spike: int | None = None
        self.spike_served = threading.Event()
        self.spike_thread: str | None = None

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> object:
        if self.uuid_error is not None:
            raise self.uuid_error
        self.handles.append(("uuid", uuid))
        return ("handle", uuid)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        self.handles.append(("index", index))
        return ("handle", index)

    def nvmlDeviceGetMemoryInfo(self, handle: object) -> SimpleNamespace:
        if self.read_error is not None:
            raise self.read_error
        used = self.used
        if self.spike is not None:
            # One reading at the spike, then memory falls back.
            used, self.spike = self.spike, None
            self.spike_thread = threading.current_thread().name
            self.spike_served.set()
        return SimpleNamespace(used=used, total=self.total, free=self.total - used)

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"570.124.06"


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """torch.cuda answering from a FakeAllocator, as on a machine with one H100."""
    alloc = FakeAllocator()
    cuda = torch.cuda

    def init() -> None:
        alloc.initialised = True

    def memory_stats(device: Any = None) -> dict[str, int]:
        alloc.seen(device)
        return {
            "allocated_bytes.all.current": alloc.allocated,
            "allocated_bytes.all.peak": alloc.peak_allocated,
            "reserved_bytes.all.current": alloc.reserved,
            "reserved_bytes.all.peak": alloc.peak_reserved,
            "num_ooms": alloc.num_ooms,
            "num_alloc_retries": alloc.num_alloc_retries,
            "inactive_split_bytes.all.current": alloc.inactive_split,
        }

    def max_memory_allocated(device: Any = None) -> int:
        alloc.seen(device)
        # As torch does: 0 until CUDA is initialised.
        return alloc.peak_allocated if alloc.initialised else 0

    def reset_peak_memory_stats(device: Any = None) -> None:
        alloc.seen(device)
        alloc.calls.append("reset_peak_memory_stats")
        alloc.peak_allocated = alloc.allocated
        alloc.peak_reserved = alloc.reserved

    def memory_allocated(device: Any = None) -> int:
        alloc.seen(device)
        return alloc.allocated

    def memory_reserved(device: Any = None) -> int:
        alloc.seen(device)
        return alloc.reserved

    def max_memory_reserved(device: Any = None) -> int:
        alloc.seen(device)
        return alloc.peak_reserved

    def synchronize(device: Any = None) -> None:
        alloc.seen(device)
        alloc.calls.append("synchronize")

    def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
        alloc.seen(device)
        return f"|  fake summary, abbreviated={abbreviated}, {alloc.allocated} bytes  |"

    def properties(device: Any = None) -> SimpleNamespace:
        alloc.seen(device)
        return SimpleNamespace(name=H100, total_memory=80 * GiB, uuid=UUID)

    def device_name(device: Any = None) -> str:
        alloc.seen(device)
        return H100

    def clear_workspaces() -> None:
        alloc.calls.append("clear_cublas_workspaces")

    patches: dict[str, Callable[..., Any]] = {
        "is_available": lambda: True,
        "init": init,
        "current_device": lambda: 0,
        "memory_stats": memory_stats,
        "memory_allocated": memory_allocated,
        "max_memory_allocated": max_memory_allocated,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "memory_reserved": memory_reserved,
        "max_memory_reserved": max_memory_reserved,
        "get_device_name": device_name,
        "get_device_properties": properties,
        "synchronize": synchronize,
        "empty_cache": alloc.empty_cache,
        "memory_summary": memory_summary,
    }
    for name, function in patches.items():
        monkeypatch.setattr(cuda, name, function)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", clear_workspaces, raising=False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    # open_sampler records why NVML is missing in a module global; restore it afterwards.
    monkeypatch.setattr(nvml, "unavailable_reason", None)
    return alloc


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    module = FakeNvml()
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.fixture
def no_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)


@pytest.fixture
def backends() -> Iterator[list[CudaBackend]]:
    """Backends a test makes; closed afterwards so no sampler thread outlives its test."""
    made: list[CudaBackend] = []
    yield made
    for backend in made:
        backend.close()


@pytest.fixture
def make_backend(
    fake_cuda: FakeAllocator, backends: list[CudaBackend]
) -> Callable[..., CudaBackend]:
    def make(index: int | None = None) -> CudaBackend:
        backend = CudaBackend(index)
        backends.append(backend)
        return backend

    return make


def sampler_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == "pytest-vram-nvml"}


# -- without a GPU -------------------------------------------------------------------------


def test_fake_cuda_unavailable_raises_backend_unavailable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(BackendUnavailable) as info:
        CudaBackend()
    message = str(info.value)
    assert "torch.cuda.is_available() is False" in message
    assert "cpu" in message
    assert "sim" in message


# -- allocator figures ---------------------------------------------------------------------


def test_fake_cuda_backend_identity(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    backend = make_backend()
    assert fake_cuda.initialised  # max_memory_allocated answers 0 before init
    assert backend.name == "cuda"
    assert backend.device == torch.device("cuda", 0)
    assert backend.device_class == H100
    assert backend.total_memory() == 80 * GiB


def test_fake_cuda_reads_allocated_peak_and_reserved(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    backend = make_backend()
    backend.begin_test()
    fake_cuda.malloc(3 * MiB)
    fake_cuda.malloc(5 * MiB)
    fake_cuda.free(5 * MiB)
    assert backend.allocated() == 3 * MiB
    assert backend.peak_allocated() == 8 * MiB
    assert backend.reserved() == 8 * MiB
    assert backend.peak_reserved() == 8 * MiB
    assert backend.peak_device() is None
    backend.end_test()


def test_fake_cuda_reset_peak(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    backend = make_backend()
    fake_cuda.malloc(1 * MiB)
    fake_cuda.malloc(9 * MiB)
    fake_cuda.free(9 * MiB)
    backend.reset_peak()
    assert "reset_peak_memory_stats" in fake_cuda.calls
    assert backend.peak_allocated() == 1 * MiB
    assert backend.peak_reserved() == 10 * MiB  # the segments are still cached
    backend.release_cache()
    backend.reset_peak()
    assert backend.peak_reserved() == 2 * MiB


def test_fake_cuda_uses_the_given_device_index(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    backend = make_backend(index=1)
    assert backend.device == torch.device("cuda", 1)
    backend.begin_test()
    backend.allocated()
    backend.peak_allocated()
    backend.reset_peak()
    backend.reserved()
    backend.peak_reserved()
    backend.release_cache()
    backend.counters()
    backend.memory_summary()
    backend.end_test()
    assert fake_cuda.devices == {1}


def test_fake_cuda_counters_are_per_test_differences(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    fake_cuda.num_ooms = 4  # from earlier tests
    fake_cuda.num_alloc_retries = 7
    backend = make_backend()

    backend.begin_test()
    fake_cuda.num_ooms += 1
    fake_cuda.num_alloc_retries += 2
    fake_cuda.inactive_split = 3 * MiB
    assert backend.counters() == {
        "num_ooms": 1,
        "num_alloc_retries": 2,
        "inactive_split_bytes": 3 * MiB,
    }
    backend.end_test()

    backend.begin_test()
    fake_cuda.inactive_split = 0
    assert backend.counters() == {"num_ooms": 0, "num_alloc_retries": 0, "inactive_split_bytes": 0}
    backend.end_test()


def test_fake_cuda_release_cache_synchronizes_then_frees(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    backend = make_backend()
    fake_cuda.calls.clear()
    backend.release_cache()
    assert fake_cuda.calls == ["synchronize", "clear_cublas_workspaces", "empty_cache"]


def test_fake_cuda_release_cache_without_cublas_workspace_hook(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(torch._C, "_cuda_clearCublasWorkspaces")
    backend = make_backend()
    fake_cuda.calls.clear()
    fake_cuda.malloc(3 * MiB)
    fake_cuda.free(3 * MiB)
    backend.release_cache()
    assert fake_cuda.calls == ["synchronize", "empty_cache"]
    assert backend.reserved() == 0


def test_fake_cuda_memory_summary(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    backend = make_backend()
    fake_cuda.malloc(4096)
    assert backend.memory_summary() == "|  fake summary, abbreviated=True, 4096 bytes  |"


def test_fake_cuda_environment(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    environment = make_backend().environment()
    assert environment["backend"] == "cuda"
    assert environment["device"] == H100
    assert environment["gpu"] == H100
    assert environment["cuda"] == "12.8"
    assert environment["driver"] == "570.124.06"
    assert environment["torch"] == torch.__version__
    assert environment["total_memory"] == 80 * GiB


def test_fake_cuda_measurement_records_reserved_and_device_peaks(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    m = TestMeasurement(backend, "t.py::test_gpu")
    fake_cuda.malloc(1 * MiB)  # a module fixture from an earlier test
    m.begin()
    fake_cuda.malloc(6 * MiB)
    fake_nvml.used = 3 * GiB
    fake_cuda.free(6 * MiB)
    fake_cuda.num_ooms += 1
    m.finish_call()
    fake_nvml.used = 1 * GiB  # teardown
    m.end()
    record = m.record
    assert record.device == H100
    assert record.backend == "cuda"
    assert record.start_allocated == 1 * MiB
    assert record.peak_allocated == 7 * MiB
    assert record.end_allocated == 1 * MiB
    assert record.peak_reserved == 8 * MiB
    assert record.peak_device == 3 * GiB
    assert record.counters["num_ooms"] == 1


# -- NVML ----------------------------------------------------------------------------------


def test_fake_cuda_nvml_handle_by_uuid(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    assert fake_nvml.handles == [("uuid", f"GPU-{UUID}")]
    assert backend.nvml_note is None


def test_fake_cuda_nvml_handle_by_index_when_uuid_fails(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    fake_nvml.uuid_error = RuntimeError("NVML_ERROR_NOT_FOUND")
    backend = make_backend(index=0)
    assert fake_nvml.handles == [("index", 0)]
    assert backend.peak_device() == 1 * GiB


def test_fake_cuda_nvml_sampler_records_a_peak_between_reads(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    backend.begin_test()
    fake_nvml.spike = 5 * GiB  # the next reading only: memory rises, then falls back
    assert fake_nvml.spike_served.wait(timeout=10)
    assert fake_nvml.spike_thread == "pytest-vram-nvml"  # seen by the background thread
    assert backend.peak_device() == 5 * GiB
    assert fake_nvml.used == 1 * GiB
    backend.reset_peak()
    assert backend.peak_device() == 1 * GiB
    backend.end_test()


def test_fake_cuda_nvml_peak_after_reset_follows_used_memory(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    backend.begin_test()
    fake_nvml.used = 2 * GiB
    assert backend.peak_device() == 2 * GiB
    fake_nvml.used = 1 * GiB
    assert backend.peak_device() == 2 * GiB
    backend.reset_peak()
    assert backend.peak_device() == 1 * GiB
    backend.end_test()


def test_fake_cuda_nvml_read_errors_do_not_crash(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    backend.begin_test()
    fake_nvml.used = 2 * GiB
    assert backend.peak_device() == 2 * GiB
    fake_nvml.read_error = RuntimeError("NVML_ERROR_GPU_IS_LOST")
    assert backend.peak_device() == 2 * GiB
    backend.end_test()


@pytest.mark.parametrize("pause_first", [False, True])
def test_fake_cuda_nvml_close_stops_the_thread(
    fake_cuda: FakeAllocator, fake_nvml: FakeNvml, pause_first: bool
) -> None:
    before = sampler_threads()
    backend = CudaBackend()
    try:
        started = sampler_threads() - before
        assert len(started) == 1
        backend.begin_test()
        if pause_first:
            backend.end_test()
    finally:
        backend.close()
    (thread,) = started
    assert not thread.is_alive()
    assert backend.peak_device() is None
    backend.close()  # closing twice is harmless


def test_fake_cuda_without_pynvml(
    make_backend: Callable[..., CudaBackend], no_pynvml: None
) -> None:
    assert nvml.open_sampler(0) is None
    assert nvml.unavailable_reason is not None
    assert "pynvml" in nvml.unavailable_reason
    assert "nvidia-ml-py" in nvml.unavailable_reason

    before = sampler_threads()
    backend = make_backend()
    assert sampler_threads() == before
    assert backend.nvml_note == nvml.unavailable_reason
    assert backend.peak_device() is None
    assert "driver" not in backend.environment()
    backend.begin_test()
    backend.reset_peak()
    backend.end_test()


def test_fake_cuda_when_nvml_init_fails(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    fake_nvml.init_error = RuntimeError("NVML Shared Library Not Found")
    assert nvml.open_sampler(0) is None
    assert nvml.unavailable_reason is not None
    assert "NVML Shared Library Not Found" in nvml.unavailable_reason

    backend = make_backend()
    assert backend.peak_device() is None
    assert backend.nvml_note is not None
    assert "NVML Shared Library Not Found" in backend.nvml_note


def test_fake_cuda_nvml_reason_cleared_once_it_loads(
    fake_cuda: FakeAllocator, fake_nvml: FakeNvml
) -> None:
    fake_nvml.init_error = RuntimeError("Driver Not Loaded")
    assert nvml.open_sampler(0) is None
    fake_nvml.init_error = None
    sampler = nvml.open_sampler(0)
    try:
        assert sampler is not None
        assert nvml.unavailable_reason is None
        assert sampler.used() == 1 * GiB
        assert sampler.driver_version() == "570.124.06"
    finally:
        if sampler is not None:
            sampler.close()
