"""Device-level used memory, sampled on a background thread from a driver's management library.

The allocator's figures miss what the driver sees: the CUDA or HIP context, library
workspaces, other processes' allocations. A :class:`MemorySampler` polls a
:class:`~pytest_vram.backends.cuda.source.MemorySource` for them and keeps the peak; the cuda
backend chooses the source (:func:`~pytest_vram.backends.cuda.backend.open_device_sampler`).
"""

from __future__ import annotations

import threading

from pytest_vram.backends.cuda.source import MemorySource

__all__ = ["MemorySampler"]


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
