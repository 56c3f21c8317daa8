"""Device-level used memory from NVML, sampled on a background thread.

NVML sees what the PyTorch allocator does not: the CUDA context, library workspaces and other
processes' or libraries' allocations. It is optional: without the driver library or the
``pynvml`` module, :func:`open_sampler` returns None and says why in ``unavailable_reason``.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["NvmlSampler", "open_sampler", "unavailable_reason"]

unavailable_reason: str | None = None


class NvmlSampler:
    """Polls one GPU's used memory and keeps the peak since the last reset."""

    def __init__(self, nvml: Any, handle: Any, interval: float = 0.002) -> None:
        self._nvml = nvml
        self._handle = handle
        self._interval = interval
        self._lock = threading.Lock()
        self._peak = 0
        self._running = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pytest-vram-nvml", daemon=True)
        self._thread.start()

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def driver_version(self) -> str:
        version = self._nvml.nvmlSystemGetDriverVersion()
        return version.decode() if isinstance(version, bytes) else str(version)

    def start(self) -> None:
        """Sample until :meth:`pause`; the peak starts from the current reading."""
        self.reset()
        self._running.set()

    def pause(self) -> None:
        self._sample()
        self._running.clear()

    def reset(self) -> None:
        with self._lock:
            self._peak = 0
        self._sample()

    def peak(self) -> int:
        self._sample()
        with self._lock:
            return self._peak

    def close(self) -> None:
        self._stop.set()
        self._running.set()
        self._thread.join(timeout=1)

    def _sample(self) -> None:
        try:
            used = self.used()
        except Exception:  # a GPU that fell off the bus must not take the test run with it
            return
        with self._lock:
            self._peak = max(self._peak, used)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._running.wait()
            if self._stop.is_set():
                return
            self._sample()
            self._stop.wait(self._interval)


def open_sampler(device_index: int) -> NvmlSampler | None:
    """A sampler for the CUDA device ``device_index``, or None (see ``unavailable_reason``)."""
    global unavailable_reason
    try:
        import pynvml
    except ImportError:
        unavailable_reason = "the pynvml module (package nvidia-ml-py) is not installed"
        return None
    try:
        pynvml.nvmlInit()
        handle = _handle_for(pynvml, device_index)
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        unavailable_reason = f"NVML could not be initialised: {exc}"
        return None
    unavailable_reason = None
    return NvmlSampler(pynvml, handle)


def _handle_for(pynvml: Any, device_index: int) -> Any:
    # CUDA_VISIBLE_DEVICES renumbers devices for CUDA but not for NVML; the UUID is the same.
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(
                text if text.startswith("GPU-") else f"GPU-{text}"
            )
        except Exception:
            pass
    return pynvml.nvmlDeviceGetHandleByIndex(device_index)
