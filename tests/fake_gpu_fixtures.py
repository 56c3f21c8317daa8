"""Fixtures for the fake GPU surfaces of fake_gpu.py; test modules load them with
``pytest_plugins = ["fake_gpu_fixtures"]``."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fake_gpu import FakeAllocator, FakeAmdSmi, FakeNvml, allocator_backend

from pytest_vram.backends.cuda.backend import CudaBackend


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """torch.cuda answering from a FakeAllocator, as on a machine with one H100."""
    alloc = install_fake_cuda(monkeypatch)
    # A worker of the run that tests these fakes must not move them to another device.
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_VRAM_WORKER_GPUS", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return alloc


def install_fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    """Patch torch.cuda to answer from a new FakeAllocator (a conftest.py can call it too)."""
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

    def reset_accumulated_memory_stats(device: Any = None) -> None:
        alloc.seen(device)
        alloc.calls.append("reset_accumulated_memory_stats")
        alloc.num_ooms = alloc.num_alloc_retries = 0

    def memory_allocated(device: Any = None) -> int:
        alloc.seen(device)
        return alloc.allocated

    def memory_reserved(device: Any = None) -> int:
        alloc.seen(device)
        return alloc.reserved

    def max_memory_reserved(device: Any = None) -> int:
        alloc.seen(device)
        return alloc.peak_reserved

    def memory_summary(device: Any = None, abbreviated: bool = False) -> str:
        alloc.seen(device)
        return f"|  fake summary, abbreviated={abbreviated}, {alloc.allocated} bytes  |"

    def properties(device: Any = None) -> SimpleNamespace:
        return alloc.gpus[alloc.seen(device)]

    def device_name(device: Any = None) -> str:
        return alloc.gpus[alloc.seen(device)].name

    patches: dict[str, Callable[..., Any]] = {
        "is_available": lambda: True,
        "init": init,
        "current_device": lambda: alloc.current,
        "device_count": lambda: len(alloc.gpus),
        "set_device": alloc.set_device,
        "memory_stats": memory_stats,
        "memory_allocated": memory_allocated,
        "max_memory_allocated": max_memory_allocated,
        "reset_peak_memory_stats": reset_peak_memory_stats,
        "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
        "memory_reserved": memory_reserved,
        "max_memory_reserved": max_memory_reserved,
        "get_device_name": device_name,
        "get_device_properties": properties,
        "synchronize": alloc.synchronize,
        "empty_cache": alloc.empty_cache,
        "memory_summary": memory_summary,
        "current_blas_handle": alloc.current_blas_handle,
        "get_allocator_backend": allocator_backend,
    }
    for name, function in patches.items():
        monkeypatch.setattr(cuda, name, function)
        if name.startswith("reset_"):  # torch.cuda.memory's spelling, which torch's own calls
            monkeypatch.setattr(cuda.memory, name, function)
    monkeypatch.setattr(cuda.memory, "_record_memory_history", alloc.record_memory_history)
    monkeypatch.setattr(cuda.memory, "_snapshot", alloc.snapshot)
    monkeypatch.setattr(
        torch._C, "_cuda_clearCublasWorkspaces", alloc.clear_workspaces, raising=False
    )
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.version, "hip", None)
    return alloc


@pytest.fixture
def fake_nvml(monkeypatch: pytest.MonkeyPatch, fake_cuda: FakeAllocator) -> FakeNvml:
    """pynvml whose readings include what the fake torch.cuda's process uses on the GPU."""
    module = FakeNvml()
    module.alloc = fake_cuda
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return module


@pytest.fixture
def no_pynvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)


@pytest.fixture
def fake_amdsmi(monkeypatch: pytest.MonkeyPatch) -> FakeAmdSmi:
    module = FakeAmdSmi()
    monkeypatch.setitem(sys.modules, "amdsmi", module)
    return module


@pytest.fixture
def no_amdsmi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "amdsmi", None)


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
