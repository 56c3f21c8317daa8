"""The real device: the PyTorch caching allocator's statistics, and NVML where it loads."""

from __future__ import annotations

from typing import Any

import torch

from pytest_vram.backends import nvml
from pytest_vram.backends.base import Backend, BackendUnavailable

__all__ = ["CudaBackend"]

# Allocator counters that only grow; the test's figure is the difference over the test.
_COUNTERS = {"num_ooms": "num_ooms", "num_alloc_retries": "num_alloc_retries"}


class CudaBackend(Backend):
    """Allocated and reserved bytes from ``torch.cuda.memory_stats`` on the current device."""

    name = "cuda"

    def __init__(self, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "the cuda backend needs a CUDA GPU, and torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                "use --vram-backend=auto, cpu or sim on machines without one"
            )
        # max_memory_allocated() quietly answers 0 until CUDA is initialised.
        torch.cuda.init()
        self.index = torch.cuda.current_device() if index is None else index
        self.device = torch.device("cuda", self.index)
        self._nvml = nvml.open_sampler(self.index)
        self._counters_at_start: dict[str, int] = {}

    @property
    def device_class(self) -> str:
        return torch.cuda.get_device_name(self.index)

    @property
    def nvml_note(self) -> str | None:
        """Why device-level figures are missing, or None when NVML is sampling."""
        return None if self._nvml is not None else nvml.unavailable_reason

    def total_memory(self) -> int | None:
        return int(torch.cuda.get_device_properties(self.index).total_memory)

    def begin_test(self) -> None:
        self._counters_at_start = self._read_counters()
        if self._nvml is not None:
            self._nvml.start()

    def end_test(self) -> None:
        if self._nvml is not None:
            self._nvml.pause()

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
        if self._nvml is not None:
            self._nvml.reset()

    def reserved(self) -> int | None:
        return int(torch.cuda.memory_reserved(self.index))

    def peak_reserved(self) -> int | None:
        return int(torch.cuda.max_memory_reserved(self.index))

    def peak_device(self) -> int | None:
        return self._nvml.peak() if self._nvml is not None else None

    def release_cache(self) -> None:
        torch.cuda.synchronize(self.index)
        # cuBLAS keeps its workspaces as allocated blocks; free them so that the next test's
        # first matmul is counted in that test, whichever test ran before it.
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
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
        env["cuda"] = str(torch.version.cuda)
        env["gpu"] = self.device_class
        env["total_memory"] = self.total_memory()
        if self._nvml is not None:
            env["driver"] = self._nvml.driver_version()
        return env

    def close(self) -> None:
        if self._nvml is not None:
            self._nvml.close()
            self._nvml = None

    def _read_counters(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.index)
        figures = {key: int(stats.get(stat, 0)) for key, stat in _COUNTERS.items()}
        figures["inactive_split_bytes"] = int(stats.get("inactive_split_bytes.all.current", 0))
        return figures
