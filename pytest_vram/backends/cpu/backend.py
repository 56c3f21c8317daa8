"""Real execution on the CPU, with the bytes of live tensor storages counted exactly."""

from __future__ import annotations

import operator
import os
from typing import TYPE_CHECKING, Any, Protocol

import torch

from pytest_vram.backends import CPU_COUNTERS
from pytest_vram.backends.base import Backend, BackendUnavailable
from pytest_vram.backends.cpu import allocator as cpu_allocator
from pytest_vram.backends.cpu.allocator import AllocatorCounter, CounterUnavailable

if TYPE_CHECKING:
    from pytest_vram.backends.tracker import StorageTracker

__all__ = ["CpuBackend", "DispatchCounter"]

# A C attribute read from C: Tensor.device builds a new object on every read.
_is_cpu = operator.attrgetter("is_cpu")


class Counter(Protocol):
    name: str
    current: int
    peak: int

    def watch(self) -> None: ...

    def unwatch(self) -> None: ...

    def reset_peak(self) -> None: ...


class DispatchCounter:
    """Counts the storages that dispatched ops create or resize, from a ``TorchDispatchMode``.

    Needs no compiler, but costs every op a Python call, and sees only what ops return: the
    blocks a kernel allocates for itself are not counted.
    """

    name = "dispatch"

    def __init__(self) -> None:
        from pytest_vram.backends.tracker import StorageTracker

        # A view of, or an in-place op on, a tensor made before tracking allocates nothing.
        self.tracker = StorageTracker(counts=_is_cpu, count_unseen_aliases=False)

    def watch(self) -> None:
        self.tracker.mode.__enter__()

    def unwatch(self) -> None:
        self.tracker.mode.__exit__(None, None, None)

    @property
    def current(self) -> int:
        return self.tracker.current

    @property
    def peak(self) -> int:
        return self.tracker.peak

    def reset_peak(self) -> None:
        self.tracker.reset_peak()


class CpuBackend(Backend):
    """Counts the CPU memory that tensors get on the test's thread while it runs.

    With the ``allocator`` counter that is every block PyTorch's CPU allocator hands out, the
    ones kernels allocate for themselves and the small tensors Python numbers become included;
    with the ``dispatch`` counter, the storages that ops return. The count goes on across tests,
    so storages a module-scoped fixture made in an earlier test still count in later ones.
    Tensors made without PyTorch's allocator (``torch.from_numpy``) and on threads the test
    starts itself are not seen.
    """

    name = "cpu"
    device = torch.device("cpu")
    # The allocator counter names no storage: attribution pushes a tracker of its own.
    attribution_filter = _is_cpu

    def __init__(self, counter: str = "auto") -> None:
        self._notes: list[str] = []
        self.counter: Counter = self._open(counter)
        self._watching = False
        self._log: Any = None
        if isinstance(self.counter, AllocatorCounter):
            # Its figures, read without a Python call in between: several reads a test.
            self.allocated = self.counter.read_current  # type: ignore[method-assign]
            self.peak_allocated = self.counter.read_peak  # type: ignore[method-assign]
            self.allocation_log = self._allocation_log

    def _open(self, counter: str) -> Counter:
        if counter not in CPU_COUNTERS:
            raise BackendUnavailable(
                f"unknown cpu counter {counter!r}: expected one of {', '.join(CPU_COUNTERS)}"
            )
        if counter == "dispatch":
            return DispatchCounter()
        try:
            allocator = AllocatorCounter()
        except CounterUnavailable as exc:
            if counter == "allocator":
                raise BackendUnavailable(f"the cpu backend's allocator counter: {exc}") from None
            self._notes.append(
                f"cpu backend counts from Python, which is slower and does not see what kernels "
                f"allocate for themselves: {exc}"
            )
            return DispatchCounter()
        self._notes += cpu_allocator.notes()  # where the library came from, if not the cache
        return allocator

    def _allocation_log(self) -> Any:
        if self._log is None:
            from pytest_vram.backends.cpu.allocatorlog import AllocatorLog

            assert isinstance(self.counter, AllocatorCounter)
            self._log = AllocatorLog(self.counter)
        return self._log

    @property
    def tracker(self) -> StorageTracker | None:  # type: ignore[override]
        """The dispatch counter's tracker; None with the allocator counter."""
        return self.counter.tracker if isinstance(self.counter, DispatchCounter) else None

    def total_memory(self) -> int | None:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            return None

    def begin_test(self) -> None:
        if not self._watching:
            try:
                self.counter.watch()
            except CounterUnavailable as exc:
                raise BackendUnavailable(f"the cpu backend cannot count: {exc}") from None
            self._watching = True

    def end_test(self) -> None:
        # The count goes on: stopping and starting it for every test would cost more than a
        # small test's own work. pause() stops it.
        pass

    def pause(self) -> None:
        if self._watching:
            self._watching = False
            self.counter.unwatch()

    def allocated(self) -> int:
        return self.counter.current

    def peak_allocated(self) -> int:
        return self.counter.peak

    def reset_peak(self) -> None:
        self.counter.reset_peak()

    def storage_bytes(self, tensor: torch.Tensor) -> int | None:
        if tensor.device.type != "cpu" or type(tensor).__name__ == "FakeTensor":
            return None
        return tensor.untyped_storage().nbytes()

    def notes(self) -> list[str]:
        return list(self._notes)

    def environment(self) -> dict[str, Any]:
        env = super().environment()
        env["cpu_counter"] = self.counter.name
        return env
