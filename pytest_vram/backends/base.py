"""The backend contract: everything a caller outside ``backends/`` may ask of a backend.

A backend measures one device. Every backend answers the figures (``allocated``,
``peak_allocated``, ``reset_peak``; ``reserved`` and the others where it has them, else None)
and brackets each measured test with ``begin_test`` and ``end_test``. Beyond the figures, a
backend declares its abilities here, each with the default that a backend without it gets:

- what it sees of allocations: ``tracker`` (its own storage tracker), ``attribution_filter``
  (which tensors a tracker pushed for attribution counts), ``allocation_log`` (a log of what it
  counts, for the peak's categories), ``segments`` and ``own_segments``
  (a model of the caching allocator's segments);
- what it cannot measure here: ``unmeasured``, and ``order_dependent_figures`` (never stored);
- whether it is a real CUDA device (``is_cuda_device``) and whether its allocator records its
  own history for snapshots and leak sites (``memory_history``, ``snapshot_note``);
- whether it computes values (``computing``, ``use_values``: the simulated device may not);
- a test's own reserved memory, apart from other tests' (``own_reserved`` and the rest);
- ``device_backend``: the backend itself, behind a test's view of it.

Callers ask these and never a backend's name, so that adding a backend means overriding what
it has here, and nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from pytest_vram.backends.segments import CachingAllocatorModel, OwnSegments
    from pytest_vram.backends.tracker import StorageTracker

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

    # -- abilities: what callers outside backends/ ask, with the default of a backend
    # without them (docs/architecture.md, "The backend contract") -------------------------

    #: The storage tracker that sees every storage this backend counts (sim, and cpu's
    #: dispatch counter), None where it counts elsewhere. Attribution, snapshots and leak
    #: sites listen to it.
    tracker: StorageTracker | None = None
    #: Where the backend keeps no tracker of its own: which tensors a tracker pushed for
    #: attribution (only while it records) counts, ``is_cpu`` or ``is_cuda``. None: attribution
    #: sees no allocation on this backend. Asked by ``attribution.sources``.
    attribution_filter: Callable[[Any], bool] | None = None
    #: Where the backend logs what it counts (the cpu allocator counter; the simulated device
    #: while a computing test counts in its op counter): the log of the allocations, which a
    #: breakdown listens to as to a tracker, or None when the tracker is to be listened to
    #: now. None where it never logs. Asked by ``attribution.recorder``.
    allocation_log: Callable[[], Any] | None = None
    #: The caching allocator's segments as modelled (the simulated device), None where the
    #: backend models none: snapshots draw the model's segments.
    segments: CachingAllocatorModel | None = None
    #: The running test's own segments (``OwnSegments``), laid out apart from what other
    #: tests hold, None where the backend models none. Ownership tells them of the storages
    #: a test's fixtures hold (:meth:`own_memory`); max_size caps them at a capacity.
    own_segments: OwnSegments | None = None
    #: A real CUDA (or ROCm) device, behind torch.cuda's caching allocator: max_size caps the
    #: allocator with ``torch.cuda.set_per_process_memory_fraction``.
    is_cuda_device: bool = False
    #: Whether the device's allocator records its own history
    #: (``torch.cuda.memory._record_memory_history``): snapshots and leak sites read it back
    #: instead of listening to a tracker.
    memory_history: bool = False
    #: Whether tests run on real values. False on the simulated device while a test runs
    #: shape-only: the session then explains an error that needs values.
    computing: bool = True

    @property
    def device_class(self) -> str:
        """The key of the baseline file: a GPU model, or the backend's name."""
        return self.name

    @property
    def device_backend(self) -> Backend:
        """The backend itself, whose figures are the whole device's; a test's view of it
        (``ownership.OwnView``) answers with the backend it views. Asked by max_size, whose
        attempts reset and read the device, not one test's share of it."""
        return self

    @property
    def unmeasured(self) -> dict[str, str]:
        """Per metric this backend cannot measure here (``reserved``, ``device``), why; a budget
        on such a metric is reported as not checked, with the reason."""
        return {}

    @property
    def snapshot_note(self) -> str | None:
        """Why the allocator's history (:attr:`memory_history`) cannot be recorded here, None
        when it can: a failing test's snapshot is then reported missing with this reason."""
        return None

    def use_values(
        self, computing: bool, reason: str | None = None, *, guess: bool = False
    ) -> None:
        """Run the next test shape-only or on real values (:attr:`computing`); ``reason`` says
        why it computes, ``guess`` that it computes on a guess. The session tells every
        backend before each test; only the simulated device can run shape-only."""

    def show_cuda(self, shown: bool) -> None:
        """Whether the next test's code sees a CUDA device (``torch.cuda.is_available()``)
        where the backend simulates one; where not (a test simulated only because every test
        is gated), it sees the machine's answers, as without the plugin, and is measured all
        the same. Only the simulated device has a device to show."""

    def own_reserved(self) -> int | None:
        """The running test's own reserved bytes; the device's (:meth:`reserved`) where the
        backend lays out no :attr:`own_segments`. A test's view reads it."""
        return self.reserved()

    def own_peak_reserved(self) -> int | None:
        """The peak of :meth:`own_reserved`."""
        return self.peak_reserved()

    def own_memory(self, held: list[torch.Tensor]) -> None:
        """The storages ``held`` by the next test's broader-scoped fixtures, laid out first on
        its :attr:`own_segments`; nothing where there are none."""

    def restart_own(self) -> None:
        """A broader-scoped fixture was made in the test's setup: its own figures start again
        from what is alive now (:attr:`own_segments`); nothing where there are none."""

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

    def release_blocks(self) -> None:
        """Hand cached memory back but keep what libraries keep between calls: between
        benchmark rounds, each of which would otherwise pay for a new cuBLAS workspace. The
        same as :meth:`release_cache` where the backend keeps nothing of the kind."""
        self.release_cache()

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
