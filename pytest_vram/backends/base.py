"""What every backend offers the measurement: current and peak allocated bytes, and cleanup."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Backend", "BackendUnavailable"]


class BackendUnavailable(Exception):
    """The requested backend cannot run here (no GPU for ``cuda``, say)."""


class Backend:
    """A device whose memory is measured.

    ``begin_test``/``end_test`` bracket one test's setup, call and teardown; between them
    ``allocated`` and ``peak_allocated`` read the device, and ``reset_peak`` starts a new peak
    window. Optional figures (reserved, NVML) are None where the backend has none.
    """

    name: str = ""
    #: Where the test should put its tensors; each backend sets it.
    device: torch.device
    #: The figures this backend reads from the whole device, so that what other tests still
    #: hold (their fixtures, a cache) changes them: reported, never stored in a baseline.
    order_dependent_figures: frozenset[str] = frozenset()

    @property
    def device_class(self) -> str:
        """The key of the baseline file: a GPU model, or the backend's name."""
        return self.name

    @property
    def unmeasured(self) -> dict[str, str]:
        """Per metric this backend cannot measure here (``reserved``, ``device``), why; a budget
        on such a metric is reported as not checked, with the reason."""
        return {}

    def total_memory(self) -> int | None:
        """The device's capacity in bytes, None when unlimited."""
        return None

    def begin_test(self) -> None:
        """Start watching allocations for one test (or go on watching, after ``end_test``)."""

    def end_test(self) -> None:
        """The test is over. A backend may go on watching until :meth:`pause`, so that a run of
        measured tests does not pay for stopping and starting between each two of them."""

    def pause(self) -> None:
        """Stop watching: what runs next is not a measured test on this backend."""

    def allocated(self) -> int:
        raise NotImplementedError

    def peak_allocated(self) -> int:
        raise NotImplementedError

    def reset_peak(self) -> None:
        raise NotImplementedError

    def reserved(self) -> int | None:
        return None

    def peak_reserved(self) -> int | None:
        return None

    def peak_device(self) -> int | None:
        """Device-level used memory (NVML), peak since the last reset."""
        return None

    def storage_bytes(self, tensor: torch.Tensor) -> int | None:
        """The bytes this backend counts for ``tensor``'s storage, None when it does not
        count that tensor (another device's, say)."""
        return None

    def release_workspaces(self) -> None:
        """Let go of what libraries keep for themselves between calls (cuBLAS's workspaces),
        which no test's leftover memory should count."""

    def release_cache(self) -> None:
        """Hand cached memory back to the device (``torch.cuda.empty_cache`` and the like)."""

    def counters(self) -> dict[str, int]:
        """Allocator event counts for the test (OOMs, retries); empty where none exist."""
        return {}

    def memory_summary(self) -> str:
        """A human-readable state of the allocator, shown when a test runs out of memory."""
        return ""

    def explain_error(self, exc: BaseException) -> str | None:
        """A message to report instead of ``exc`` when the backend caused it, else None."""
        return None

    def notes(self) -> list[str]:
        """What the run's summary should say about this backend (a fallback it took)."""
        return []

    def environment(self) -> dict[str, Any]:
        import torch

        return {"backend": self.name, "device": self.device_class, "torch": str(torch.__version__)}

    def close(self) -> None:
        """Release what the backend holds for the session (threads, handles)."""
        self.pause()
