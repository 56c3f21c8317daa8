"""The cuda backend and the NVML sampler against a fake torch.cuda and a fake pynvml.

Every test here replaces torch.cuda's memory functions with a small allocator model
(tests/fake_gpu.py), so they run without a GPU and check what the backend reads, resets and calls.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from fake_gpu import H100, UUID, FakeAllocator, FakeNvml, GiB, MiB, gpu, sampler_threads

from pytest_vram.backends import nvml
from pytest_vram.backends.base import BackendUnavailable
from pytest_vram.backends.cuda import CudaBackend
from pytest_vram.backends.sampler import SourceUnavailable, open_device_sampler
from pytest_vram.measurement import TestMeasurement

# The fakes' fixtures: fake_cuda, fake_nvml, no_pynvml, make_backend, backends.
pytest_plugins = ["fake_gpu_fixtures"]

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
    fake_cuda.gpus.append(gpu())
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
    sampler, reason, mig = open_device_sampler(0)
    assert sampler is None
    assert reason is not None
    assert "pynvml" in reason
    assert "nvidia-ml-py" in reason
    assert not mig

    before = sampler_threads()
    backend = make_backend()
    assert sampler_threads() == before
    assert backend.nvml_note == reason
    assert backend.peak_device() is None
    assert "driver" not in backend.environment()
    backend.begin_test()
    backend.reset_peak()
    backend.end_test()


def test_fake_cuda_when_nvml_init_fails(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    fake_nvml.init_error = RuntimeError("NVML Shared Library Not Found")
    with pytest.raises(SourceUnavailable, match="NVML Shared Library Not Found"):
        nvml.open_source(0)

    backend = make_backend()
    assert backend.peak_device() is None
    assert backend.nvml_note is not None
    assert "NVML Shared Library Not Found" in backend.nvml_note


def test_fake_cuda_nvml_opens_once_it_loads(fake_cuda: FakeAllocator, fake_nvml: FakeNvml) -> None:
    fake_nvml.init_error = RuntimeError("Driver Not Loaded")
    assert open_device_sampler(0)[0] is None
    fake_nvml.init_error = None
    sampler, reason, _ = open_device_sampler(0)
    try:
        assert sampler is not None
        assert reason is None
        assert sampler.used() == 1 * GiB
        assert sampler.driver_version() == "570.124.06"
    finally:
        if sampler is not None:
            sampler.close()
