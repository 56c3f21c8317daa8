"""The real device: the PyTorch caching allocator's statistics, and the driver's view of the
device (NVML on NVIDIA GPUs, amdsmi on ROCm) where its library loads.

One class serves a fleet: under pytest-xdist each worker takes its own GPU, a MIG slice is
named (and baselined) as the slice, and a ROCm build of torch is recorded as HIP.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch

from pytest_vram.backends.base import Backend, BackendUnavailable
from pytest_vram.backends.nvml import visible_mig_uuid
from pytest_vram.backends.sampler import open_device_sampler
from pytest_vram.units import format_size

__all__ = ["WORKER_GPUS", "CudaBackend", "worker_device_index"]

#: The environment variable that chooses how pytest-xdist workers pick their GPU: ``spread``
#: (the default: worker gwN takes device N modulo the device count) or ``current`` (leave
#: the current device as it is, for workers pinned some other way).
WORKER_GPUS = "PYTEST_VRAM_WORKER_GPUS"

# Allocator counters that only grow; the test's figure is the difference over the test.
_COUNTERS = {"num_ooms": "num_ooms", "num_alloc_retries": "num_alloc_retries"}


def worker_device_index(
    device_count: int, worker: str | None = None, policy: str | None = None
) -> int | None:
    """The GPU a pytest-xdist worker takes: ``gwN`` takes device N modulo ``device_count``.

    None outside pytest-xdist, or when ``policy`` (default: ``$PYTEST_VRAM_WORKER_GPUS``) is
    ``current``. ``worker`` defaults to ``$PYTEST_XDIST_WORKER``, which pytest-xdist sets in
    each worker to its id.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "") if worker is None else worker
    policy = os.environ.get(WORKER_GPUS, "spread") if policy is None else policy
    policy = policy.strip().lower() or "spread"
    if policy not in ("spread", "current"):
        raise BackendUnavailable(f"{WORKER_GPUS}={policy!r}: expected spread or current")
    match = re.fullmatch(r"gw(\d+)", worker)
    if policy == "current" or match is None or device_count < 1:
        return None
    return int(match.group(1)) % device_count


class CudaBackend(Backend):
    """Allocated and reserved bytes from ``torch.cuda.memory_stats`` on one device: ``index``,
    else this pytest-xdist worker's GPU, else the current device."""

    name = "cuda"
    # The real allocator's segments and the device's used memory include what other tests'
    # fixtures hold and what the allocator keeps for them: they depend on which tests ran.
    order_dependent_figures = frozenset({"peak_reserved", "peak_device"})

    def __init__(self, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "the cuda backend needs a CUDA GPU, and torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                "use --vram-backend=auto, cpu or sim on machines without one"
            )
        # max_memory_allocated() quietly answers 0 until CUDA is initialised.
        torch.cuda.init()
        if index is None:
            index = worker_device_index(torch.cuda.device_count())
            if index is None:
                index = torch.cuda.current_device()
            else:
                # A test's device="cuda" means the current device: make it this worker's.
                torch.cuda.set_device(index)
        self.index = index
        self.device = torch.device("cuda", self.index)
        #: A ROCm build: HIP under torch.cuda's names, amdsmi for the device's used memory.
        self.rocm = bool(getattr(torch.version, "hip", None))
        self._sampler, self._sampler_note, mig = open_device_sampler(self.index, rocm=self.rocm)
        name = torch.cuda.get_device_name(self.index)
        #: Whether the device is a MIG slice; its device class then names the slice.
        self.mig = bool(
            mig
            or " MIG " in f" {name} "
            or (not self.rocm and visible_mig_uuid(self.index) is not None)
        )
        self._device_class = self._slice_name(name) if self.mig else name
        self._counters_at_start: dict[str, int] = {}

    @property
    def device_class(self) -> str:
        return self._device_class

    def _slice_name(self, name: str) -> str:
        """A MIG slice's device class: its profile's name, as NVML or torch gives it."""
        if " MIG " in f" {name} ":
            return name
        named = self._sampler.source.device_name if self._sampler is not None else None
        if named and "MIG" in named:
            return named  # "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
        # Without NVML the slice's size tells one profile from another.
        return f"{name} MIG {format_size(self.total_memory() or 0)}"

    @property
    def nvml_note(self) -> str | None:
        """Why device-level figures are missing (no NVML, or no amdsmi on ROCm), or None when
        they are sampled."""
        return None if self._sampler is not None else self._sampler_note

    def total_memory(self) -> int | None:
        return int(torch.cuda.get_device_properties(self.index).total_memory)

    def begin_test(self) -> None:
        self._counters_at_start = self._read_counters()
        if self._sampler is not None:
            self._sampler.start()

    def end_test(self) -> None:
        if self._sampler is not None:
            self._sampler.pause()

    def storage_bytes(self, tensor: torch.Tensor) -> int | None:
        if tensor.device != self.device:
            return None
        # The caching allocator hands out multiples of 512 bytes.
        return (tensor.untyped_storage().nbytes() + 511) // 512 * 512

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.index))

    def peak_allocated(self) -> int:
        return int(torch.cuda.max_memory_allocated(self.index))

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.index)
        if self._sampler is not None:
            self._sampler.reset()

    def reserved(self) -> int | None:
        return int(torch.cuda.memory_reserved(self.index))

    def peak_reserved(self) -> int | None:
        return int(torch.cuda.max_memory_reserved(self.index))

    def peak_device(self) -> int | None:
        return self._sampler.peak() if self._sampler is not None else None

    def release_cache(self) -> None:
        torch.cuda.synchronize(self.index)
        # cuBLAS keeps its workspaces as allocated blocks; free them so that the next test's
        # first matmul is counted in that test, whichever test ran before it.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        torch.cuda.empty_cache()

    def release_blocks(self) -> None:
        """Hand the cached blocks back, keeping cuBLAS's workspaces: between benchmark rounds,
        where freeing them would make each round's first matmul pay for a new one."""
        torch.cuda.synchronize(self.index)
        torch.cuda.empty_cache()

    def counters(self) -> dict[str, int]:
        now = self._read_counters()
        figures = {key: now[key] - self._counters_at_start.get(key, 0) for key in _COUNTERS}
        figures["inactive_split_bytes"] = now["inactive_split_bytes"]
        return figures

    def memory_summary(self) -> str:
        return torch.cuda.memory_summary(self.index, abbreviated=True)

    def environment(self) -> dict[str, Any]:
        env = super().environment()
        if self.rocm:
            env["hip"] = str(torch.version.hip)
        else:
            env["cuda"] = str(torch.version.cuda)
        env["gpu"] = self.device_class
        env["total_memory"] = self.total_memory()
        if self.mig:
            env["mig"] = True
        if self._sampler is not None:
            env["device_memory"] = self._sampler.source.name
            driver = self._sampler.driver_version()
            if driver:
                env["driver"] = driver
        return env

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None

    def _read_counters(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.index)
        figures = {key: int(stats.get(stat, 0)) for key, stat in _COUNTERS.items()}
        figures["inactive_split_bytes"] = int(stats.get("inactive_split_bytes.all.current", 0))
        return figures
