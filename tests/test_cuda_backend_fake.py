"""The cuda backend and the NVML sampler against a fake torch.cuda and a fake pynvml.

Every test here replaces torch.cuda's memory functions with a small allocator model
(tests/fake_gpu.py), so they run without a GPU and check what the backend reads, resets and calls.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fake_gpu import (
    CUBLAS_HANDLE,
    CUBLAS_WORKSPACE,
    CUDA_CONTEXT,
    DEVICE_ASSERT,
    DRIVER_RESERVE,
    H100,
    UUID,
    CudaError,
    FakeAllocator,
    FakeNvml,
    GiB,
    MiB,
    gpu,
    nvml_gpu,
    sampler_threads,
)

from pytest_vram.backends import create_backend
from pytest_vram.backends.base import BackendUnavailable
from pytest_vram.backends.cuda import nvml
from pytest_vram.backends.cuda.backend import CudaBackend, context_lost, open_device_sampler
from pytest_vram.backends.cuda.history import history_recording
from pytest_vram.backends.cuda.source import SourceUnavailable
from pytest_vram.measure.measurement import TestMeasurement
from pytest_vram.wiring.snapshots import SnapshotRecorder

TESTS = Path(__file__).parent

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
    # Only the cuBLAS workspace is left, which this torch cannot hand back.
    assert backend.reserved() == CUBLAS_WORKSPACE


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
    fake_nvml.used = 3 * GiB  # another process takes 2 GiB more
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
    # Above the device's floor: the other process's 2 GiB and this one's 8 MiB of segments.
    assert record.peak_device == 2 * GiB + 8 * MiB
    assert record.counters["num_ooms"] == 1


# -- NVML ----------------------------------------------------------------------------------


def test_fake_cuda_nvml_handle_by_uuid(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    assert fake_nvml.handles == [("uuid", f"GPU-{UUID}")]
    assert backend.nvml_note is None


def test_fake_cuda_nvml_handle_by_pci_bus_id_when_uuid_fails(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    fake_nvml.uuid_error = RuntimeError("NVML_ERROR_NOT_FOUND")
    backend = make_backend(index=0)
    assert fake_nvml.handles == [("bus", "00000000:18:00.0")]
    backend.begin_test()
    fake_nvml.used += 5 * MiB
    assert backend.peak_device() == 5 * MiB
    backend.end_test()


def test_fake_cuda_nvml_sampler_records_a_peak_between_reads(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    backend.begin_test()
    fake_nvml.spike = 5 * GiB  # the next reading only: memory rises, then falls back
    assert fake_nvml.spike_served.wait(timeout=10)
    assert fake_nvml.spike_thread == "pytest-vram-nvml"  # seen by the background thread
    assert backend.peak_device() == 4 * GiB  # above the 1 GiB it held at the floor
    assert fake_nvml.used == 1 * GiB
    backend.reset_peak()
    assert backend.peak_device() == 0
    backend.end_test()


def test_fake_cuda_nvml_peak_after_reset_follows_used_memory(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    backend.begin_test()
    fake_nvml.used = 2 * GiB
    assert backend.peak_device() == 1 * GiB
    fake_nvml.used = 1 * GiB
    assert backend.peak_device() == 1 * GiB
    backend.reset_peak()
    assert backend.peak_device() == 0
    backend.end_test()


def test_fake_cuda_nvml_read_errors_do_not_crash(
    make_backend: Callable[..., CudaBackend], fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    backend.begin_test()
    fake_nvml.used = 2 * GiB
    assert backend.peak_device() == 1 * GiB
    fake_nvml.read_error = RuntimeError("NVML_ERROR_GPU_IS_LOST")
    assert backend.peak_device() == 1 * GiB
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
        assert sampler.used() == 1 * GiB + fake_cuda.usage(0)
        assert sampler.driver_version() == "570.124.06"
    finally:
        if sampler is not None:
            sampler.close()


@pytest.mark.parametrize(
    "error",
    [
        FakeNvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        FakeNvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
        FakeNvml.NVML_ERROR_NOT_SUPPORTED,
    ],
)
def test_fake_nvml_falls_back_to_the_v1_struct_where_the_driver_lacks_v2(
    fake_cuda: FakeAllocator, fake_nvml: FakeNvml, error: int
) -> None:
    fake_nvml.v2_error = error
    source = nvml.open_source(0)
    assert source.used() == 1 * GiB + DRIVER_RESERVE  # v1 counts the reserve as used
    assert source.used() == 1 * GiB + DRIVER_RESERVE
    assert source.struct == "v1"
    assert fake_nvml.reads == ["v1", "v1"]  # v2 is not asked again


def test_fake_nvml_reads_the_v2_struct_without_the_driver_reserve(
    fake_cuda: FakeAllocator, fake_nvml: FakeNvml
) -> None:
    source = nvml.open_source(0)
    assert source.used() == 1 * GiB
    assert source.struct == "v2"
    assert fake_nvml.reads == ["v2"]


# -- the device figure: above the floor ---------------------------------------------------


def test_fake_cuda_device_floor_holds_the_context_and_a_cublas_handle(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    assert fake_cuda.contexts == {0}
    assert fake_cuda.blas_handles == {0}
    assert backend.device_floor == 1 * GiB + CUDA_CONTEXT + CUBLAS_HANDLE
    # The handle's workspace is handed back, and its peak is nobody's.
    assert backend.allocated() == 0
    assert backend.reserved() == 0
    assert backend.peak_allocated() == 0


def measure_matmul_test(backend: CudaBackend, fake_cuda: FakeAllocator, nodeid: str) -> int:
    """One test as the session runs it: caches emptied, then a first matmul (its cuBLAS
    handle and workspace) and 8 MiB of tensors; its device figure."""
    backend.release_cache()
    m = TestMeasurement(backend, nodeid)
    m.begin()
    torch.cuda.current_blas_handle()
    fake_cuda.malloc(8 * MiB)
    fake_cuda.free(8 * MiB)
    m.finish_call()
    m.end()
    assert m.record.peak_device is not None
    return m.record.peak_device


def test_fake_cuda_device_figure_does_not_depend_on_which_test_ran_first(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, fake_nvml: FakeNvml
) -> None:
    backend = make_backend()
    first = measure_matmul_test(backend, fake_cuda, "t.py::test_first")
    second = measure_matmul_test(backend, fake_cuda, "t.py::test_second")
    # Each pays for its workspace and tensors (their segments), neither for the context.
    assert first == second == CUBLAS_WORKSPACE + 8 * MiB


# -- the allocator's configuration ----------------------------------------------------------


def test_fake_cuda_async_allocator_is_recorded_and_its_missing_figures_not_measured(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    backend = make_backend()
    environment = backend.environment()
    assert environment["allocator"] == "cudaMallocAsync"
    assert environment["alloc_conf"] == "backend:cudaMallocAsync"
    backend.begin_test()
    fake_cuda.malloc(3 * MiB)
    assert backend.allocated() == 3 * MiB
    # Not zeros: figures this allocator does not keep are not measured, and say why.
    assert backend.reserved() is None
    assert backend.peak_reserved() is None
    assert backend.counters() == {}
    backend.end_test()
    assert "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync" in backend.unmeasured["reserved"]
    assert "PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync" in (backend.snapshot_note or "")


def test_fake_cuda_native_allocator_settings_are_recorded(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    backend = make_backend()
    environment = backend.environment()
    assert environment["allocator"] == "native"
    assert environment["alloc_conf"] == "expandable_segments:True"
    assert backend.reserved() == 0
    assert backend.unmeasured == {"device": backend.nvml_note}
    assert backend.snapshot_note is None


# -- torchrun: each rank on its own GPU -----------------------------------------------------


@pytest.fixture
def torchrun_rank(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    """The variables torchrun sets for one rank of two on one node."""

    def rank(local_rank: int) -> None:
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
        monkeypatch.setenv("RANK", str(local_rank))
        monkeypatch.setenv("LOCAL_RANK", str(local_rank))

    return rank


def test_fake_cuda_torchrun_rank_allocates_and_measures_on_its_gpu(
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    torchrun_rank: Callable[[int], None],
    backends: list[CudaBackend],
) -> None:
    fake_cuda.gpus = [gpu(uuid=f"{n:08x}-0b6a-4c5e-9d7f-2a1b3c4d5e6f") for n in range(2)]
    torchrun_rank(1)
    backend = create_backend("cuda")
    backends.append(backend)  # type: ignore[arg-type]
    assert backend.device == torch.device("cuda", 1)
    # device="cuda" in the rank's test is its own GPU, not GPU 0.
    assert fake_cuda.set_device_calls == [1]
    assert torch.cuda.current_device() == 1


def test_fake_cuda_torchrun_one_visible_gpu_per_rank(
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    torchrun_rank: Callable[[int], None],
    backends: list[CudaBackend],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")  # the rank sees its GPU as device 0
    torchrun_rank(1)
    backend = create_backend("cuda")
    backends.append(backend)  # type: ignore[arg-type]
    assert backend.device == torch.device("cuda", 0)
    assert fake_cuda.set_device_calls == [0]


def test_fake_cuda_torchrun_rank_without_its_gpu_is_a_clear_error(
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    torchrun_rank: Callable[[int], None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda.gpus = [gpu(), gpu()]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    torchrun_rank(1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    with pytest.raises(BackendUnavailable) as info:
        create_backend("cuda")
    message = str(info.value)
    assert "LOCAL_RANK=3" in message
    assert "sees 2 devices" in message
    assert "CUDA_VISIBLE_DEVICES='2,3'" in message
    assert fake_cuda.set_device_calls == []


# -- NVML finds the CUDA device's GPU, never NVML's at the same index ----------------------

OTHER = "1c3e5a7b-9d2f-4b6a-8c1e-3f5a7b9d2f4b"


@pytest.fixture
def two_gpus(fake_cuda: FakeAllocator, fake_nvml: FakeNvml) -> FakeNvml:
    """A host with two GPUs, NVML's in PCI order; the GPU at bus 3B is busy with another
    process's 30 GiB."""
    fake_nvml.gpus = [
        nvml_gpu(f"GPU-{UUID}", "00000000:18:00.0", used=0),
        nvml_gpu(f"GPU-{OTHER}", "00000000:3B:00.0", used=30 * GiB),
    ]
    return fake_nvml


def test_fake_cuda_nvml_finds_the_gpu_by_pci_bus_id_in_another_order(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    two_gpus: FakeNvml,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # CUDA_VISIBLE_DEVICES=1: CUDA's device 0 is NVML's device 1, and torch gives no UUID.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    fake_cuda.gpus = [gpu(uuid=None, bus=0x3B)]
    backend = make_backend()
    assert two_gpus.handles == [("bus", "00000000:3B:00.0")]
    backend.begin_test()
    two_gpus.gpus[0].used = 50 * GiB  # NVML's device 0: another GPU, not measured
    fake_cuda.malloc(6 * MiB)
    assert backend.peak_device() == 6 * MiB
    backend.end_test()


def test_fake_cuda_nvml_finds_the_gpu_by_uuid_in_another_order(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, two_gpus: FakeNvml
) -> None:
    # CUDA_DEVICE_ORDER=FASTEST_FIRST put NVML's second GPU first.
    fake_cuda.gpus = [gpu(uuid=OTHER, bus=0x3B), gpu(uuid=UUID, bus=0x18)]
    backend = make_backend(index=1)
    assert two_gpus.handles == [("uuid", f"GPU-{UUID}")]
    assert backend.device_floor == CUDA_CONTEXT + CUBLAS_HANDLE  # not the other GPU's 30 GiB


def test_fake_cuda_nvml_without_the_gpu_leaves_the_device_figure_unchecked(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    two_gpus: FakeNvml,
) -> None:
    fake_cuda.gpus = [gpu(uuid="00000000-0000-4000-8000-000000000000", bus=0x5E)]
    before = sampler_threads()
    backend = make_backend()
    assert sampler_threads() == before
    assert ("index", 0) not in two_gpus.handles
    assert backend.peak_device() is None
    note = backend.nvml_note or ""
    assert "00000000:5E:00.0" in note
    assert "not checked" in note
    assert backend.unmeasured["device"] == note


# -- a CUDA error that leaves the context unusable ------------------------------------------


def test_fake_cuda_device_side_assert_is_a_lost_context() -> None:
    assert context_lost(CudaError(DEVICE_ASSERT))
    assert context_lost(RuntimeError("CUDA error: an illegal memory access was encountered"))
    try:
        try:
            raise CudaError(DEVICE_ASSERT)
        except RuntimeError as exc:
            raise ValueError("while reading the loss") from exc
    except ValueError as wrapped:
        assert context_lost(wrapped)
    assert not context_lost(CudaError("CUDA error: invalid argument"))
    assert not context_lost(torch.cuda.OutOfMemoryError("CUDA out of memory."))


def test_fake_cuda_assert_after_a_test_fails_the_next_at_setup_naming_it(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    backend = make_backend()
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "t.py::test_breaks (setup)")
    backend.begin_test()
    fake_cuda.device_assert()  # launched; nothing in the test waits for it
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "t.py::test_breaks (teardown)")
    backend.end_test()  # the error surfaces here, and is kept for later
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "t.py::test_next (setup)")
    for clean_up in (backend.release_cache, backend.begin_test):
        with pytest.raises(pytest.fail.Exception) as info:
            clean_up()
        message = str(info.value)
        assert "since t.py::test_breaks raised" in message
        assert "device-side assert triggered" in message
        assert "fresh process" in message


CONFTEST = f"""
import sys
sys.path.insert(0, {str(TESTS)!r})
import pytest
from fake_gpu_fixtures import install_fake_cuda

sys.modules["pynvml"] = None
alloc = install_fake_cuda(pytest.MonkeyPatch())


@pytest.fixture
def fake_gpu():
    return alloc
"""


def run_on_fake_gpu(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, *args: str
) -> pytest.RunResult:
    """A pytest run in its own process, whose torch.cuda is the fake one."""
    for name in ("PYTEST_XDIST_WORKER", "CUDA_VISIBLE_DEVICES", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    pytester.makeconftest(CONFTEST)
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:randomly", *args)


@pytest.mark.slow
def test_fake_cuda_run_after_a_device_side_assert_fails_each_later_test_once_clearly(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(
        test_gpu="""
        import torch

        def test_first(vram):
            pass

        def test_breaks(vram, fake_gpu):
            fake_gpu.device_assert()
            torch.cuda.synchronize()  # reading a result waits for the kernel

        def test_later(vram):
            pass

        def test_last(vram):
            pass
        """
    )
    result = run_on_fake_gpu(pytester, monkeypatch, "--vram-backend=cuda")
    result.assert_outcomes(passed=1, failed=1, errors=2)
    output = result.stdout.str()
    result.stdout.fnmatch_lines(
        [
            "*_ test_breaks _*",
            "*CUDA error: device-side assert triggered. The CUDA context of this process is "
            "unusable from here on*",
        ]
    )
    lost = (
        "not run: the CUDA context of this process is unusable since test_gpu.py::test_breaks "
        "raised a CUDA error (CUDA error: device-side assert triggered)"
    )
    # test_later's and test_last's sections, at setup; the short summary repeats each (cut to
    # the terminal's width, except on CI).
    sections = [line for line in output.splitlines() if line.startswith(lost)]
    assert len(sections) == 2, output
    assert "ERROR at setup of test_later" in output
    assert "ERROR at setup of test_last" in output
    assert "Traceback" not in output
    assert "--max-worker-restart" in output


@pytest.mark.slow
def test_fake_cuda_run_under_the_async_allocator_says_why_figures_are_missing(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "backend:cudaMallocAsync")
    pytester.makepyfile(
        test_gpu="""
        def test_passes(vram, fake_gpu):
            fake_gpu.malloc(4096)

        def test_fails(vram, fake_gpu):
            fake_gpu.malloc(4096)
            assert False
        """
    )
    result = run_on_fake_gpu(
        pytester,
        monkeypatch,
        "--vram-backend=cuda",
        "--vram-snapshot-on-fail=snaps",
        "--vram-json=out.json",
    )
    result.assert_outcomes(passed=1, failed=1)  # no history to record is no setup error
    result.stdout.fnmatch_lines(
        [
            "*no memory snapshot of test_gpu.py::test_fails: PYTORCH_CUDA_ALLOC_CONF="
            "backend:cudaMallocAsync: the cudaMallocAsync allocator records no allocation "
            "history*"
        ]
    )
    assert not (pytester.path / "snaps").exists()
    document = json.loads((pytester.path / "out.json").read_text())
    assert len(document["tests"]) == 2
    for test in document["tests"]:
        assert test["peak_reserved"] is None  # not measured, rather than zero
    (environment,) = document["environments"].values()
    assert environment["allocator"] == "cudaMallocAsync"
    assert environment["alloc_conf"] == "backend:cudaMallocAsync"


# -- snapshots: each test's own history -----------------------------------------------------


def test_fake_cuda_snapshot_holds_only_the_failing_tests_history(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    tmp_path: Path,
) -> None:
    backend = make_backend()
    recorder = SnapshotRecorder(tmp_path)
    recorder.start(backend)  # an earlier test's allocations
    fake_cuda.malloc(1 * MiB)
    fake_cuda.malloc(2 * MiB)
    recorder.stop()
    recorder.start(backend)  # the test that fails
    fake_cuda.malloc(3 * MiB)
    path = recorder.dump(backend, "t.py::test_fails")
    assert path is not None
    trace = pickle.loads(path.read_bytes())["device_traces"][0]
    assert trace == [{"action": "alloc", "size": 3 * MiB}]
    # Python stacks and a bounded history: C++ stacks cost more than the tests need.
    assert {call["stacks"] for call in fake_cuda.history_calls} == {"python"}
    assert max(call["max_entries"] for call in fake_cuda.history_calls) <= 20_000


def test_fake_cuda_snapshot_history_stops_at_the_sessions_end(
    fake_cuda: FakeAllocator, no_pynvml: None, tmp_path: Path
) -> None:
    backend = CudaBackend()
    try:
        SnapshotRecorder(tmp_path).start(backend)
        assert fake_cuda.recording is not None
    finally:
        backend.close()  # the pool closes its backends when the session ends
    assert fake_cuda.recording is None
    assert not history_recording()


def test_fake_cuda_snapshot_history_cleared_on_a_torch_without_clear_history(
    make_backend: Callable[..., CudaBackend],
    fake_cuda: FakeAllocator,
    no_pynvml: None,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def record_memory_history(
        enabled: str | None = "all",
        context: str | None = "all",
        stacks: str = "all",
        max_entries: int = 1,
    ) -> None:
        fake_cuda.record_memory_history(enabled, context, stacks, max_entries)

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record_memory_history)
    backend = make_backend()
    recorder = SnapshotRecorder(tmp_path)
    recorder.start(backend)
    fake_cuda.malloc(1 * MiB)
    recorder.start(backend)
    fake_cuda.malloc(3 * MiB)
    assert fake_cuda.trace == [{"action": "alloc", "size": 3 * MiB}]
