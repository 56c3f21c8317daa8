"""Device-level used memory, sampled on a background thread from a driver's management library.

The allocator's figures miss what the driver sees: the CUDA or HIP context, library
workspaces, other processes' allocations. A :class:`MemorySource` reads that used memory for
one device: NVML on NVIDIA GPUs (:mod:`pytest_vram.backends.cuda.nvml`), amdsmi on ROCm
(:mod:`pytest_vram.backends.cuda.amdsmi`). Both are optional: where the library or its module is
missing, :func:`open_device_sampler` returns no sampler and says why.
"""

from __future__ import annotations

import threading
from typing import Protocol

__all__ = ["MemorySampler", "MemorySource", "SourceUnavailable", "open_device_sampler"]


class SourceUnavailable(Exception):
    """A memory source cannot be opened here; the message says why.

    ``mig`` is True when the library saw that the device is a MIG slice without being able to
    read the slice itself: the device is still named as one.
    """

    def __init__(self, reason: str, *, mig: bool = False) -> None:
        super().__init__(reason)
        self.mig = mig


class MemorySource(Protocol):
    """One device's used memory, as its driver's management library reads it."""

    #: The library's name: ``nvml`` or ``amdsmi`` (it names the sampler's thread).
    name: str
    #: Whether the device is a MIG slice (NVIDIA's Multi-Instance GPU).
    mig: bool
    #: The name the library gives the device (a MIG slice's profile name), None when unknown.
    device_name: str | None

    def used(self) -> int:
        """Bytes in use on the device now."""
        ...

    def driver_version(self) -> str | None: ...

    def close(self) -> None: ...


class MemorySampler:
    """Polls one device's used memory and keeps the peak since the last reset."""

    def __init__(self, source: MemorySource, interval: float = 0.002) -> None:
        self.source = source
        self._interval = interval
        self._lock = threading.Lock()
        self._peak = 0
        self._running = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"pytest-vram-{source.name}", daemon=True
        )
        self._thread.start()

    def used(self) -> int:
        return self.source.used()

    def driver_version(self) -> str | None:
        return self.source.driver_version()

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
        self.source.close()

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


def open_device_sampler(
    device_index: int, *, rocm: bool = False
) -> tuple[MemorySampler | None, str | None, bool]:
    """A sampler for the torch device ``device_index``: ``(sampler, reason, mig)``.

    NVML reads an NVIDIA GPU, amdsmi an AMD one (``rocm``). Without a sampler, ``reason``
    says why device-level figures are not measured; ``mig`` tells whether the device was
    seen to be a MIG slice either way.
    """
    if rocm:
        from pytest_vram.backends.cuda import amdsmi as library
    else:
        from pytest_vram.backends.cuda import nvml as library  # type: ignore[no-redef]
    try:
        source = library.open_source(device_index)
    except SourceUnavailable as exc:
        return None, str(exc), exc.mig
    return MemorySampler(source), None, source.mig
