"""Real execution on the CPU, with the bytes of live tensor storages counted exactly."""

from __future__ import annotations

import operator
import os

import torch

from pytest_vram.backends.base import Backend
from pytest_vram.backends.tracker import StorageTracker

__all__ = ["CpuBackend"]


# A C attribute read from C: Tensor.device builds a new object on every read.
_is_cpu = operator.attrgetter("is_cpu")


class CpuBackend(Backend):
    """Counts CPU tensor storages created or resized by dispatched ops while a test runs.

    The tracker stays alive across tests, so storages a module-scoped fixture made in an earlier
    test still count in later ones. Tensors made without the dispatcher (``torch.from_numpy``)
    and on threads the test starts itself are not seen.
    """

    name = "cpu"
    device = torch.device("cpu")

    def __init__(self) -> None:
        # A view of, or an in-place op on, a tensor made before tracking allocates nothing.
        self.tracker = StorageTracker(counts=_is_cpu, count_unseen_aliases=False)
        self._active = False

    def total_memory(self) -> int | None:
        try:
            return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            return None

    def begin_test(self) -> None:
        if not self._active:
            self.tracker.mode.__enter__()
            self._active = True

    def end_test(self) -> None:
        # The mode stays pushed: entering and leaving it for every test would cost more than
        # the test's own dispatches when tests are small. pause() pops it.
        pass

    def pause(self) -> None:
        if self._active:
            self._active = False
            self.tracker.mode.__exit__(None, None, None)

    def allocated(self) -> int:
        return self.tracker.current

    def peak_allocated(self) -> int:
        return self.tracker.peak

    def reset_peak(self) -> None:
        self.tracker.reset_peak()
