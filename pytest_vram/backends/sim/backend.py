"""The simulated device: CUDA memory of code that runs on fake tensors, in seconds, without a GPU.

Shape-only, a measured test runs under PyTorch's ``FakeTensorMode``
(:mod:`~pytest_vram.backends.sim.fakemode`): every tensor carries its
shape, dtype and storage size but no data, so nothing is computed and a 32B-parameter training
step takes seconds on a laptop. Computing (``use_values(True)``, for a test that reads values),
it runs on real CPU tensors, whose op outputs an
:class:`~pytest_vram.backends.cpu.allocator.OpCounter` counts inside PyTorch's CPU allocator
(:mod:`~pytest_vram.backends.sim.opcounting`; or, where it cannot be built, with a capacity
set, or while attribution listens, the tracker's dispatch mode), within the host's memory
(:mod:`~pytest_vram.backends.sim.hostmemory`); everything else is the same, so both give the
same figures for the same allocations.

A :class:`~pytest_vram.backends.tracker.StorageTracker` counts the live storages as the CUDA
caching allocator would hand them out (multiples of 512 bytes), a
:class:`~pytest_vram.backends.segments.CachingAllocatorModel` replays the allocator's segments
for reserved memory and out-of-memory, and :class:`~pytest_vram.backends.sim.fakecuda.VirtualCuda`
makes ``device="cuda"``, ``.cuda()``, ``torch.autocast("cuda")`` and ``torch.cuda.*`` queries
work on a CPU-only build of PyTorch. Shape-only,
:class:`~pytest_vram.backends.sim.known.KnownValues` keeps the values known without computing
(constants, small real tensors), so that code which reads them takes the path a real run
takes. See ``docs/sim.md``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from pytest_vram.backends.base import Backend
from pytest_vram.backends.keptpeaks import KeptPeaks
from pytest_vram.backends.segments import CachingAllocatorModel, OwnSegments, SegmentFigures
from pytest_vram.backends.sim.dynamoconfig import load_config_alone
from pytest_vram.backends.sim.fakecuda import VirtualCuda
from pytest_vram.backends.sim.fakemode import SimFakeTensorMode, on_device
from pytest_vram.backends.sim.hostmemory import HOST_MESSAGE_START, HostLimit, HostMemoryExceeded
from pytest_vram.backends.sim.hosttensors import HostTensors
from pytest_vram.backends.sim.needsvalues import explain_needs_values, needs_values_error
from pytest_vram.backends.sim.opcounting import OpCounting
from pytest_vram.backends.sim.workspaces import (
    DEFAULT_GPU,
    WORKSPACE_NAME,
    CublasWorkspaces,
    configured_workspace_size,
    gpu_model,
    matmul_ops,
)
from pytest_vram.backends.tracker import StorageTracker, round_like_cuda_allocator
from pytest_vram.units import format_size, parse_size

# HostMemoryExceeded and needs_values_error are named here for the callers that meet them
# through the backend (fit's trials, values on demand).
__all__ = ["UNLIMITED_TOTAL", "HostMemoryExceeded", "SimBackend", "needs_values_error"]

#: What ``torch.cuda.get_device_properties().total_memory`` and ``mem_get_info`` report for a
#: simulated device without a capacity: 1 PiB, more than any model here can ask for.
UNLIMITED_TOTAL = 1 << 50


def _is_host_tensor(tensor: torch.Tensor) -> bool:
    # Computing: real CPU tensors are the device's; fake ones (a shape-only test's leftovers)
    # and meta tensors are not.
    return tensor.is_cpu and not isinstance(tensor, FakeTensor)


class SimBackend(Backend):
    """A CUDA device simulated on fake tensors.

    One ``FakeTensorMode`` and one tracker serve the whole session, so that fixtures of module
    scope stay fake and counted across tests; the virtual CUDA device is installed only while a
    test runs. ``capacity`` (bytes or a size string) makes allocations that would not fit
    raise ``torch.cuda.OutOfMemoryError``; None means unlimited, unless ``gpu`` names the GPU
    model simulated: then its memory. The model (by default :data:`DEFAULT_GPU`) sets the
    size of the cuBLAS workspaces, which ``workspaces`` asks for (the plugin's backend has
    them; a backend made for one concern, without, counts tensors only).
    """

    name = "sim"

    def __init__(
        self,
        capacity: int | str | None = None,
        gpu: str | None = None,
        workspaces: bool = False,
        host_tensors: str = "device",
    ) -> None:
        #: The GPU model simulated.
        self.gpu = gpu_model(gpu or DEFAULT_GPU)
        if capacity is None and gpu is not None:
            capacity = self.gpu.total_memory
        self.capacity = None if capacity is None else parse_size(capacity)
        self.segments = CachingAllocatorModel(capacity=self.capacity)
        #: The running test's own segments, which its reserved figures are read from.
        self.own_segments = OwnSegments(self.segments)
        self.tracker = StorageTracker(
            counts=self._counts,
            size_of=round_like_cuda_allocator,
            on_allocate=self._check_host,
            allocator=self.own_segments,
            count_unseen_aliases=False,
            before_listen=self._count_in_python,
            block_size=self.own_segments.handed_out,
        )
        #: One cuBLAS workspace per thread that multiplies matrices, as on the GPU model.
        self.workspaces = CublasWorkspaces(
            configured_workspace_size(self.gpu.major) if workspaces else 0, self._new_workspace
        )
        if self.workspaces.size:
            self.tracker.watch_ops(matmul_ops(), self.workspaces.on_matmul)
        self._fake_mode: SimFakeTensorMode | None = None
        if host_tensors not in ("device", "host"):
            raise ValueError(f"host_tensors must be device or host, not {host_tensors!r}")
        #: The tensors a test keeps on the host, which the device counts (``"device"``) or
        #: not (``"host"``).
        self.host = HostTensors(
            self.counted, counts_host=host_tensors == "device", hand_over=self._hand_over
        )
        # The host is cpu, and the test's code sees the device as cuda (vram.device).
        self.device = torch.device("cuda", 0)
        self.cuda = VirtualCuda(self)
        #: Whether the next (or current) test computes values on the CPU.
        self.computing = False
        #: Whether the next (or current) test's code sees the CUDA device (:meth:`show_cuda`).
        self.cuda_shown = True
        self._counts_now = self._shape_only_counts()
        self._host_depth = 0
        self._active = False
        self._mode: Any = None
        self._counters_at_start = (0, 0)
        #: The out-of-memory errors and retries at the test's own last reset of them.
        self._stats_from = (0, 0)
        #: The peaks the test's own torch.cuda.reset_peak_memory_stats() would have lost.
        self._kept = KeptPeaks()
        #: Computing: what the test may hold of the host's memory.
        self._host = HostLimit()
        #: Computing: the op counter, for the tests it can count.
        self._ops = OpCounting(self.workspaces.size)
        #: The peak when the running test moved from the op counter to the tracker.
        self._peak_before_python = 0
        #: What the next test's broader-scoped fixtures made before it hold (:meth:`own_memory`).
        self._next_own: list[torch.Tensor] = []

    @property
    def computing_reason(self) -> str | None:
        """Why the test computes: what the shape-only run failed with, for messages."""
        return self._host.reason

    @property
    def guessing(self) -> bool:
        """Whether it computes on a guess, within
        :data:`~pytest_vram.backends.sim.hostmemory.GUESS_BUDGET`."""
        return self._host.guessing

    @property
    def fake_mode(self) -> SimFakeTensorMode:
        """The session's FakeTensorMode, made when a shape-only test first needs it (and
        without importing torch._dynamo, which a run that never compiles does not need)."""
        if self._fake_mode is None:
            load_config_alone()
            self._fake_mode = SimFakeTensorMode(self.tracker, self.host)
        return self._fake_mode

    def use_values(
        self, computing: bool, reason: str | None = None, *, guess: bool = False
    ) -> None:
        """Run the next test shape-only (False) or on real CPU tensors (True); with ``guess``,
        computing may hold :data:`~pytest_vram.backends.sim.hostmemory.GUESS_BUDGET` at most
        (more raises an out-of-memory error)."""
        if self._active:
            raise RuntimeError("the simulated device's mode changes between tests only")
        self.computing = computing
        self._host.reason = reason if computing else None
        self._host.guessing = computing and guess
        self._counts_now = _is_host_tensor if computing else self._shape_only_counts()
        # Computing, host tensors are real CPU tensors: where the device does not count them,
        # made where it counts nothing.
        self.host.uncounted = self.host_memory if computing else None

    def show_cuda(self, shown: bool) -> None:
        if self._active:
            raise RuntimeError("what the simulated device shows changes between tests only")
        self.cuda_shown = shown

    def _shape_only_counts(self) -> Callable[[torch.Tensor], bool]:
        return on_device if self.host.counts_host else self._on_device

    def _on_device(self, tensor: torch.Tensor) -> bool:
        """Shape-only: a fake tensor the test does not keep on the host."""
        return on_device(tensor) and not self.host.is_host(tensor)

    @contextlib.contextmanager
    def _hand_over(self, tensor: torch.Tensor) -> Iterator[None]:
        """``tensor``'s storage counts no more: the copy of it made inside counts it now."""
        with self.tracker.handing_over(tensor) as counted:
            if not counted:
                self._ops.forget(tensor)
            yield

    def _counts(self, tensor: torch.Tensor) -> bool:
        return self._host_depth == 0 and self._counts_now(tensor)

    @contextlib.contextmanager
    def host_memory(self) -> Iterator[None]:
        """Tensors made inside are host memory: the device does not count them (an
        optimizer's host scalars, such as AdamW's ``step`` counters)."""
        self._host_depth += 1
        try:
            with self._ops.uncounted():
                yield
        finally:
            self._host_depth -= 1

    @contextlib.contextmanager
    def as_one_op(self) -> Iterator[None]:
        """What the block allocates counts as one op's outputs would: a storage resized
        without dispatching an op (FSDP's), which the op counter would not see otherwise."""
        with self._ops.as_one_op():
            yield

    def counted(self, tensor: torch.Tensor) -> bool:
        """Whether the simulated device counts ``tensor``'s storage (it is on the device)."""
        return self.tracker.counted(tensor) or self._ops.counts(tensor)

    def _count_in_python(self) -> None:
        """Attribution listens to the tracker: the rest of the running test counts there."""
        if not (self._active and self._ops.active):
            return
        self._ops.stop()
        self._ops.lift_limit()
        # The op counter holds what it counted until it dies: the peak from here on is of the
        # sum of both counts, not the sum of their peaks.
        self._peak_before_python = self.tracker.peak + self._ops.peak
        self._ops.hand_over(self.tracker, self.workspaces)
        # No data limit: the op counter's limit was the process's.
        self._host.limit_tracker(self.tracker.current, data=False)
        self.tracker.mode.__enter__()
        self._mode = self.tracker.mode

    def allocation_log(self) -> Any:  # type: ignore[override]
        """While the running test counts in the op counter: its log, for attribution (which
        would move the test to the tracker by listening there); None otherwise."""
        return self._ops.log() if self._active and self._ops.active else None

    def _segments(self) -> SegmentFigures:
        """Both segment models' figures, summed: the tracker's and the op counter's, each for
        the tests it counts (the op counter replays its blocks on a model of its own)."""
        self.tracker.flush()  # frees of storages that died reach the segments first
        return self._ops.with_segments(self.segments.figures())

    def _inactive_split_bytes(self) -> int:
        return self.segments.inactive_split_bytes() + self._ops.inactive_split_bytes()

    def _check_host(self, nbytes: int) -> None:
        self._host.check(self.tracker.current, nbytes)

    def _limit_host(self) -> None:
        room = self._host.start()
        if room is None:
            return
        if self._ops.active:
            # The op counter refuses an allocation before it is made, a kernel's own included.
            counter = self._ops.counter
            assert counter is not None
            head, _, tail = self._host.message(None, placeholder="\0").partition("\0")
            counter.limit(self.tracker.current + counter.current + room, head, tail)
            return
        self._host.limit_tracker(self.tracker.current, data=True)

    def _unlimit_host(self) -> None:
        self._ops.lift_limit()
        self._host.stop()

    def total_memory(self) -> int | None:
        return self.capacity

    def device_total(self) -> int:
        """The device size ``torch.cuda`` reports: the capacity, or :data:`UNLIMITED_TOTAL`."""
        return self.capacity if self.capacity is not None else UNLIMITED_TOTAL

    def own_memory(self, held: list[torch.Tensor]) -> None:
        """Before the next test begins: its fixtures that were made before it hold ``held``
        (a tensor per storage). Its reserved figures (:meth:`own_reserved`) count those and its
        own allocations, on segments of their own."""
        self._next_own = held

    def begin_test(self) -> None:
        if self._active:
            return
        held, self._next_own = self._next_own, []
        self._counters_at_start = (self.segments.num_ooms, self.segments.num_alloc_retries)
        # The dispatch mode first: entering FakeTensorMode reads torch.cuda.is_available(),
        # which must be the real answer.
        computing = self.computing
        # A capacity needs its out-of-memory at the allocation, which only the tracker, which
        # asks the segments at each allocation, can raise; listeners hear from the tracker.
        # The op counter lays out what the test's fixtures hold on the test's own segments,
        # unless the tracker counts some of it (OpCounting.can_start). A fixture made in the
        # test's set-up is laid out anew once made (restart_own).
        native = (
            computing
            and self.capacity is None
            and not self.tracker.listeners
            and self._ops.can_start(held, self.tracker.counted)
        )
        mode: Any = None if native else self.tracker.mode if computing else self.fake_mode
        self._ops.active = native
        if computing:
            self._limit_host()
        try:
            if native:
                self._ops.start()
            else:
                mode.__enter__()
        except BaseException:
            self._ops.active = False
            self._unlimit_host()
            raise
        try:
            self.cuda.install(computing=computing)
        except BaseException:
            self._stop_counting(mode)
            raise
        self.tracker.flush()  # what died before the test is not its own
        # Counting natively, what the fixtures hold is laid out on the op counter's segments.
        self.own_segments.start([] if native else self._allocations_of(held))
        self._ops.own = native
        self._mode = mode
        self._active = True

    def _allocations_of(self, held: list[torch.Tensor]) -> list[tuple[Any, int]]:
        """Per storage of ``held``: the segment block it has (None where the op counter
        counts it) and its bytes."""
        found = []
        allocation_of = self.tracker.allocation_of
        for tensor in held:
            allocation = allocation_of(tensor)
            if allocation is None:
                size = self.storage_bytes(tensor)
                if size:
                    allocation = (None, size)
            if allocation is not None:
                found.append(allocation)
        return found

    def _stop_counting(self, mode: Any) -> None:
        self.tracker.beside = None
        self.workspaces.held_elsewhere = None
        self.own_segments.stop()
        self._ops.own = False
        try:
            if self._ops.active:
                self._ops.stop()
            elif mode is not None:
                mode.__exit__(None, None, None)
        finally:
            self._unlimit_host()

    def end_test(self) -> None:
        if not self._active:
            return
        self._active = False
        try:
            self.cuda.uninstall()
        finally:
            mode, self._mode = self._mode, None
            self._stop_counting(mode)

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Ops in the block are not counted: a library's shape inference on fake tensors (as
        DTensor's), which allocates nothing on a real device."""
        self.fake_mode._depth += 1  # the mode counts the outputs of depth-0 ops only
        try:
            yield
        finally:
            self.fake_mode._depth -= 1

    @property
    def active(self) -> bool:
        """Whether a test is running on the simulated device now."""
        return self._active

    # Both counts go on across tests: the tracker's (shape-only tests, and computing ones it
    # counts) and the op counter's. A test adds to one of them only, so the sum of their peaks
    # since the last reset is the peak.

    def allocated(self) -> int:
        return self.tracker.current + self._ops.current

    def peak_allocated(self) -> int:
        return self._kept.peak_allocated(self.stats_peak_allocated())

    def reset_peak(self) -> None:
        self._kept.clear()
        self._reset_peaks()

    # What the test's own code reads and resets through torch.cuda: torch's peaks, which its
    # reset_peak_memory_stats() starts again while the plugin's figures keep the peak before.

    def stats_peak_allocated(self) -> int:
        if self.tracker.beside is not None:  # the test moved to the tracker (_count_in_python)
            return max(self._peak_before_python, self.tracker.peak)
        return self.tracker.peak + self._ops.peak

    def stats_peak_reserved(self) -> int:
        return self._segments().peak_reserved

    def reset_stats_peak(self) -> None:
        self._kept.keep(self.peak_allocated(), self.peak_reserved(), self.own_peak_reserved())
        self._reset_peaks()

    def reset_stats_counters(self) -> None:
        """``torch.cuda.reset_accumulated_memory_stats()``: the counts the test reads start
        again; those of its figures (:meth:`counters`) go on."""
        self._stats_from = (self.segments.num_ooms, self.segments.num_alloc_retries)

    def _reset_peaks(self) -> None:
        self._peak_before_python = 0
        self.tracker.reset_peak()
        self.segments.reset_peak()
        own = self.own_segments.model
        if own is not None:
            own.reset_peak()
        self._ops.reset_peak()

    def storage_bytes(self, tensor: torch.Tensor) -> int | None:
        if not (self.counted(tensor) if self.computing else self._counts_now(tensor)):
            return None
        return round_like_cuda_allocator(tensor.untyped_storage().nbytes())

    def reserved(self) -> int | None:
        return self._segments().reserved

    def peak_reserved(self) -> int | None:
        return self._kept.peak_reserved(self._segments().peak_reserved)

    # The test's own reserved memory: its figures do not depend on what else is alive.

    def own_reserved(self) -> int | None:
        """The bytes of the segments the running test's own memory needs (see
        :class:`~pytest_vram.backends.segments.OwnSegments`); between tests, :meth:`reserved`."""
        own = self._own_figures()
        return self.reserved() if own is None else own.reserved

    def own_peak_reserved(self) -> int | None:
        own = self._own_figures()
        if own is None:
            return self.peak_reserved()
        return self._kept.own_peak_reserved(own.peak_reserved)

    def _own_figures(self) -> SegmentFigures | None:
        model = self.own_segments.model
        if model is None:
            return None
        self.tracker.flush()
        figures = model.figures()
        if not self._ops.own:
            return figures
        return self._ops.with_segments(figures, own=True)

    def restart_own(self) -> None:
        """A broader-scoped fixture was made: the test's own segments start again from what
        is live, as in a later test that finds it made."""
        self.tracker.flush()
        self.own_segments.restart()
        self._ops.relayout()

    def _new_workspace(self, nbytes: int) -> torch.Tensor:
        """A cuBLAS workspace: a storage of ``nbytes`` the device counts, made in an op's
        dispatch (where making a tensor would run outside the counting mode)."""
        if self.computing:
            workspace = torch.empty(nbytes, dtype=torch.uint8)
        else:
            meta = torch.empty(nbytes, dtype=torch.uint8, device="meta")
            workspace = FakeTensor(self.fake_mode, meta, torch.device("cpu"))
        self.tracker.observe(workspace)
        self.tracker.name_storage(workspace, WORKSPACE_NAME)
        return workspace

    def release_workspaces(self) -> None:
        self.workspaces.clear()
        self._ops.clear_workspaces()
        self.tracker.flush()

    def release_cache(self) -> None:
        # As the per-test clean-up on cuda: the workspaces go, then the cache.
        self.workspaces.clear()
        self._ops.clear_workspaces()
        self.empty_cache()

    def empty_cache(self) -> None:
        """``torch.cuda.empty_cache()``: the cached blocks go, the cuBLAS workspaces stay."""
        self.tracker.flush()
        self.segments.empty_cache()
        own = self.own_segments.model
        if own is not None:
            own.empty_cache()
        self._ops.empty_cache()

    def counters(self) -> dict[str, int]:
        oom_errors, retries = self._counters_at_start
        self.tracker.flush()
        own = self.own_segments.model
        if own is None:
            inactive = self._inactive_split_bytes()
        else:  # the test's own, as its reserved figures are
            inactive = own.inactive_split_bytes()
            if self._ops.own:
                inactive += self._ops.inactive_split_bytes()
        return {
            "num_ooms": self.segments.num_ooms - oom_errors,
            "num_alloc_retries": self.segments.num_alloc_retries - retries,
            "inactive_split_bytes": inactive,
        }

    def memory_stats_nested(self) -> dict[str, Any]:
        """``torch.cuda.memory_stats_as_nested_dict()`` of the simulated device."""
        allocated, peak = self.allocated(), self.stats_peak_allocated()
        figures, model = self._segments(), self.segments  # the counters are the model's

        def stat(current: int, peak: int | None = None) -> dict[str, dict[str, int]]:
            return {"all": {"current": current, "peak": current if peak is None else peak}}

        return {
            "allocated_bytes": stat(allocated, peak),
            "active_bytes": stat(allocated, peak),
            "reserved_bytes": stat(figures.reserved, figures.peak_reserved),
            "inactive_split_bytes": stat(self._inactive_split_bytes()),
            "segment": stat(figures.segments),
            "num_alloc_retries": model.num_alloc_retries - self._stats_from[1],
            "num_ooms": model.num_ooms - self._stats_from[0],
            "num_device_alloc": figures.num_device_alloc,
            "num_device_free": figures.num_device_free,
        }

    def memory_summary(self) -> str:
        allocated, peak = self.allocated(), self.stats_peak_allocated()
        figures, model = self._segments(), self.segments  # the counters are the model's
        reserved, peak_reserved = figures.reserved, figures.peak_reserved
        capacity = "unlimited" if self.capacity is None else format_size(self.capacity)
        return "\n".join(
            [
                "pytest-vram simulated CUDA device (sim backend)",
                f"  allocated: {format_size(allocated)} (peak {format_size(peak)})",
                f"  reserved:  {format_size(reserved)} (peak {format_size(peak_reserved)})"
                f" in {figures.segments} segments",
                f"  cached, not allocated: {format_size(figures.reserved - figures.allocated)}"
                f" ({format_size(self._inactive_split_bytes())} in partly used segments)",
                f"  capacity: {capacity}",
                f"  out-of-memory errors: {model.num_ooms - self._stats_from[0]}, allocator "
                f"retries: {model.num_alloc_retries - self._stats_from[1]}",
            ]
        )

    def explain_error(self, exc: BaseException) -> str | None:
        if not self.computing:
            return explain_needs_values(exc)
        if isinstance(exc, HostMemoryExceeded) or HOST_MESSAGE_START in str(exc):
            return None  # its message says it all
        if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):
            return self._host.message(None)
        return None

    def environment(self) -> dict[str, Any]:
        env = super().environment()
        env["sim_capacity"] = self.capacity
        env["sim_gpu"] = self.gpu.name
        env["sim_host_tensors"] = "device" if self.host.counts_host else "host"
        return env

    def close(self) -> None:
        self.end_test()
