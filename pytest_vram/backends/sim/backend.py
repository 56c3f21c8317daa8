"""The simulated device: CUDA memory of code that runs on fake tensors, in seconds, without a GPU.

Shape-only, a measured test runs under PyTorch's ``FakeTensorMode``: every tensor carries its
shape, dtype and storage size but no data, so nothing is computed and a 32B-parameter training
step takes seconds on a laptop. Computing (``use_values(True)``, for a test that reads values),
it runs on real CPU tensors, whose op outputs an
:class:`~pytest_vram.backends.cpu.allocator.OpCounter` counts inside PyTorch's CPU allocator
(or, where it cannot be built, with a capacity set, or while attribution listens, the tracker's
dispatch mode); everything else is the same, so both give the same figures for the same
allocations.

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
import os
import resource
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

from pytest_vram.backends.base import Backend
from pytest_vram.backends.cpu import allocator as cpu_allocator
from pytest_vram.backends.segments import CachingAllocatorModel, OwnSegments, SegmentFigures
from pytest_vram.backends.sim.dynamoconfig import load_config_alone
from pytest_vram.backends.sim.fakecuda import VirtualCuda
from pytest_vram.backends.sim.known import KnownValues
from pytest_vram.backends.sim.ops import accumulates_in_place
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

__all__ = [
    "UNLIMITED_TOTAL",
    "HostMemoryExceeded",
    "SimBackend",
    "available_host_memory",
    "needs_values_error",
]

#: What ``torch.cuda.get_device_properties().total_memory`` and ``mem_get_info`` report for a
#: simulated device without a capacity: 1 PiB, more than any model here can ask for.
UNLIMITED_TOTAL = 1 << 50

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_GROUPED_MM = torch.ops.aten._grouped_mm.default
_ADD = torch.ops.aten.add.Tensor
_ADD_IN_PLACE = torch.ops.aten.add_.Tensor
_NEEDS_VALUES = (DataDependentOutputException, DynamicOutputShapeException)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_FRAMEWORK_MARKERS = (
    os.sep + "_pytest" + os.sep,
    os.sep + "pluggy" + os.sep,
    os.sep + "contextlib.py",
)


_HOST_MESSAGE_START = "the simulated device computes this test's values on the CPU"

#: What computing leaves the rest of the host: a tenth of what was available, at least this.
HOST_MARGIN = 512 << 20
#: The most a test computing on a guess may hold: past it, computing was the wrong guess
#: (shape-only, the test needs no host memory), and a cheap one to have made.
GUESS_BUDGET = 1 << 30


class HostMemoryExceeded(torch.OutOfMemoryError):
    """Computing a test's values on the CPU would need more memory than the host has.

    The op counter refuses such an allocation with a ``torch.OutOfMemoryError`` of the same
    message; the tracker, with this subclass of it."""


def available_host_memory() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` in bytes; None where there is no such file.

    Read again after a second at most: each computing test asks, and the figure moves slowly
    next to the margin the limit leaves."""
    global _available_read
    now = time.monotonic()
    read_at, available = _available_read
    if now - read_at < _AVAILABLE_FOR_S:
        return available
    available = _read_available()
    _available_read = (now, available)
    return available


_AVAILABLE_FOR_S = 1.0
_available_read: tuple[float, int | None] = (-_AVAILABLE_FOR_S, None)


def _read_available() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _data_size() -> int | None:
    """The process's data segment and private writable mappings (``VmData``), in bytes."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmData:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _is_host_tensor(tensor: torch.Tensor) -> bool:
    # Computing: real CPU tensors are the device's; fake ones (a shape-only test's leftovers)
    # and meta tensors are not.
    return tensor.is_cpu and not isinstance(tensor, FakeTensor)


def _on_device(tensor: torch.Tensor) -> bool:
    # Every fake tensor of the simulation is device memory, host tensors included; meta
    # tensors are shapes only, and real tensors were made outside the simulation.
    return isinstance(tensor, FakeTensor) and tensor.fake_device.type != "meta"


def needs_values_error(exc: BaseException | None) -> BaseException | None:
    """The FakeTensorMode error in ``exc``'s chain that says an op needed tensor values."""
    pending = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, _NEEDS_VALUES):
            return current
        pending.extend((current.__context__, current.__cause__))
    return None


def _user_location(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``exc``'s traceback in the test's own code."""
    location = None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not (
            filename.startswith((_TORCH_DIR, _PACKAGE_DIR))
            or any(marker in filename for marker in _FRAMEWORK_MARKERS)
        ):
            location = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return location


def _grouped_mm(
    mode: FakeTensorMode, func: Any, types: Any, args: tuple, kwargs: dict[str, Any]
) -> Any:
    """``torch._grouped_mm`` as the CPU kernel runs it.

    The meta kernel checks what CUDA's Hopper kernel needs (bfloat16 inputs); the CPU kernel,
    and CUDA's fallback, multiply float32 and float16 too (a Mixtral's experts in float32 or
    under autocast). For those, the result is the meta kernel's shape in the input's dtype.
    """
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args, strict=False)) | kwargs
    mat_a, mat_b = bound["mat_a"], bound["mat_b"]
    if (
        (mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16)
        or bound.get("bias") is not None
        or not isinstance(mat_a, FakeTensor)
        or mat_a.dtype != mat_b.dtype
    ):
        return mode.dispatch(func, types, args, kwargs)
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    with in_kernel_invocation_manager(mode):
        out = _create_grouped_mm_output_tensor(
            mat_a, mat_b, bound.get("offs"), bound.get("out_dtype")
        )
    return FakeTensor(mode, out, mat_a.fake_device)


class _SimFakeTensorMode(FakeTensorMode):
    """FakeTensorMode that counts the storages of what each op returns.

    Counting here, rather than in a second dispatch mode stacked on top, saves a trip through
    Python for every op; only the ops a program calls are counted, not those FakeTensorMode
    runs inside them (decompositions), just as a mode stacked above would see them.
    """

    # Like the storage tracker's mode, this one opts out of the wrapper torch puts around every
    # mode's dispatch to keep Dynamo out of it: the wrapper costs every op, and nothing here
    # is compiled.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self._observe_output = tracker.observe_output
        self._depth = 0
        #: What is known of the fake tensors' values without computing them.
        self.known = KnownValues()

    def __deepcopy__(self, memo: dict[int, Any]) -> _SimFakeTensorMode:
        # copy.deepcopy(model) copies each fake tensor's __dict__, its mode included; there is
        # one simulated device, and the copies belong to it.
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is _LOCAL_SCALAR:
            # .item(), bool(t): a value known without computing is the value a real run reads.
            value = self.known.item(args[0])
            if value is not None:
                return value
        elif func is _ADD and accumulates_in_place(func, args, kwargs, sys._getframe(1)):
            func = _ADD_IN_PLACE  # the autograd engine's gradient sum, in place as on CUDA
        self._depth += 1
        try:
            if func is _GROUPED_MM:
                out = _grouped_mm(self, func, types, args, kwargs or {})
            else:
                out = self.dispatch(func, types, args, kwargs)
        finally:
            self._depth -= 1
        if self._depth == 0:
            # Queries such as prim.device, a third of the ops, return no tensor: skip them cheaply.
            if isinstance(out, (torch.Tensor, tuple, list)):
                self._observe_output(func, out)
            self.known.after(func, args, kwargs or {}, out)
        return out


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
    device = torch.device("cpu")

    def __init__(
        self, capacity: int | str | None = None, gpu: str | None = None, workspaces: bool = False
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
        self._fake_mode: _SimFakeTensorMode | None = None
        self.cuda = VirtualCuda(self)
        #: Whether the next (or current) test computes values on the CPU.
        self.computing = False
        #: Why it computes: what the shape-only run failed with, for messages.
        self.computing_reason: str | None = None
        #: Whether it computes on a guess, within :data:`GUESS_BUDGET`.
        self.guessing = False
        self._counts_now = _on_device
        self._host_depth = 0
        self._active = False
        self._mode: Any = None
        self._counters_at_start = (0, 0)
        #: Computing: the most the tracker may count before the host runs out.
        self._host_limit: int | None = None
        self._host_room: int | None = None
        self._host_available: int | None = None
        self._saved_data_limit: tuple[int, int] | None = None
        #: Computing: the op counter, made for the first computing test (None until then, or
        #: where it cannot be built: then the tracker counts).
        self._ops: cpu_allocator.OpCounter | None = None
        self._ops_unavailable: str | None = None
        #: Whether the running test counts with the op counter.
        self._native = False
        #: Whether the op counter's segments are the running test's own: they were empty
        #: when it started counting there.
        self._own_ops = False
        #: What the next test's fixtures made before it hold, and whether it has fixtures of
        #: a broader scope (:meth:`own_memory`).
        self._next_own: tuple[list[torch.Tensor], bool] | None = None

    @property
    def fake_mode(self) -> _SimFakeTensorMode:
        """The session's FakeTensorMode, made when a shape-only test first needs it (and
        without importing torch._dynamo, which a run that never compiles does not need)."""
        if self._fake_mode is None:
            load_config_alone()
            self._fake_mode = _SimFakeTensorMode(self.tracker)
        return self._fake_mode

    def use_values(
        self, computing: bool, reason: str | None = None, *, guess: bool = False
    ) -> None:
        """Run the next test shape-only (False) or on real CPU tensors (True); with ``guess``,
        computing may hold :data:`GUESS_BUDGET` at most (more raises an out-of-memory error)."""
        if self._active:
            raise RuntimeError("the simulated device's mode changes between tests only")
        self.computing = computing
        self.computing_reason = reason if computing else None
        self.guessing = computing and guess
        self._counts_now = _is_host_tensor if computing else _on_device

    def _counts(self, tensor: torch.Tensor) -> bool:
        return self._host_depth == 0 and self._counts_now(tensor)

    @contextlib.contextmanager
    def host_memory(self) -> Iterator[None]:
        """Tensors made inside are host memory: the device does not count them (an
        optimizer's host scalars, such as AdamW's ``step`` counters)."""
        self._host_depth += 1
        native = self._ops if self._native else None
        try:
            if native is None:
                yield
            else:
                with native.uncounted():
                    yield
        finally:
            self._host_depth -= 1

    @contextlib.contextmanager
    def as_one_op(self) -> Iterator[None]:
        """What the block allocates counts as one op's outputs would: a storage resized
        without dispatching an op (FSDP's), which the op counter would not see otherwise."""
        native = self._ops if self._native else None
        if native is None:
            yield
        else:
            with native.as_one_op():
                yield

    def counted(self, tensor: torch.Tensor) -> bool:
        """Whether the simulated device counts ``tensor``'s storage (it is on the device)."""
        if self.tracker.counted(tensor):
            return True
        ops = self._ops
        if ops is None or isinstance(tensor, FakeTensor) or not tensor.is_cpu:
            return False
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return False
        data = storage.data_ptr()
        # An empty storage allocates nothing, on the device as anywhere.
        return ops.counts(data) if data != 0 else storage.nbytes() == 0

    def _op_counter(self) -> cpu_allocator.OpCounter | None:
        """The op counter, made on first use; None where it cannot be built or loaded."""
        if self._ops is None and self._ops_unavailable is None:
            try:
                self._ops = cpu_allocator.OpCounter()
            except cpu_allocator.CounterUnavailable as exc:
                self._ops_unavailable = str(exc)
        return self._ops

    def _count_in_python(self) -> None:
        """Attribution listens to the tracker: the rest of the running test counts there."""
        if not (self._active and self._native):
            return
        ops = self._ops
        assert ops is not None
        ops.unwatch()
        ops.limit(None)
        self._native = False
        if self._host_room is not None:
            self._host_limit = self.tracker.current + self._host_room
        self.tracker.mode.__enter__()
        self._mode = self.tracker.mode

    def _segments(self) -> SegmentFigures:
        """Both segment models' figures, summed: the tracker's and the op counter's, each for
        the tests it counts (the op counter replays its blocks on a model of its own)."""
        self.tracker.flush()  # frees of storages that died reach the segments first
        figures = self.segments.figures()
        if self._ops is None:
            return figures
        return SegmentFigures(*map(sum, zip(figures, self._ops.segments(), strict=True)))

    def _inactive_split_bytes(self) -> int:
        ops = self._ops
        return self.segments.inactive_split_bytes() + (
            ops.inactive_split_bytes() if ops is not None else 0
        )

    def _check_host(self, nbytes: int) -> None:
        limit = self._host_limit
        if limit is None:
            return
        needed = self.tracker.current + nbytes
        if needed > limit:
            raise HostMemoryExceeded(self._host_message(needed))

    def _host_message(self, needed: int | None, *, placeholder: str | None = None) -> str:
        """What a computing test that the host cannot hold fails with; with ``placeholder``,
        that text stands where the bytes that would be live go (the op counter fills it in)."""
        available = self._host_available
        if placeholder is not None:
            what = f"{placeholder} of tensors would be live"
        elif needed is not None:
            what = f"{format_size(needed)} of tensors would be live"
        else:
            what = "an allocation did not fit"
        if self.guessing:
            return (
                f"{_HOST_MESSAGE_START} on a guess, which may hold {format_size(GUESS_BUDGET)}: "
                f"{what}. It runs again shape-only."
            )
        return (
            f"{_HOST_MESSAGE_START}, and this host has not the memory for it: {what}, with "
            f"{format_size(available) if available is not None else 'an unknown amount'} "
            "available when the test started"
            + (f" (it needs values: {self.computing_reason})" if self.computing_reason else "")
            + ". Shape-only, on fake tensors, any size fits: keep the test from reading tensor "
            "values (.item(), value asserts, a DataLoader) so that it runs shape-only, or run it "
            'on a GPU runner (@pytest.mark.vram_backend("cuda")).'
        )

    def _limit_host(self) -> None:
        available = available_host_memory()
        self._host_available = available
        room = None if available is None else max(0, available - max(HOST_MARGIN, available // 10))
        if self.guessing:
            room = GUESS_BUDGET if room is None else min(room, GUESS_BUDGET)
        if room is None:
            self._host_limit = self._host_room = None
            return
        self._host_room = room
        if self._native:
            # The op counter refuses an allocation before it is made, a kernel's own included.
            assert self._ops is not None
            head, _, tail = self._host_message(None, placeholder="\0").partition("\0")
            self._ops.limit(self.tracker.current + self._ops.current + room, head, tail)
            self._host_limit = None
            return
        self._host_limit = self.tracker.current + room
        # A kernel writes its output before the tracker sees it: a limit on the process's
        # data makes an allocation that cannot fit fail cleanly instead of waking the
        # kernel's out-of-memory killer.
        data = _data_size()
        if data is None:
            return
        try:
            saved = resource.getrlimit(resource.RLIMIT_DATA)
            hard = saved[1]
            soft = data + room
            if hard != resource.RLIM_INFINITY:
                soft = min(soft, hard)
            resource.setrlimit(resource.RLIMIT_DATA, (soft, hard))
        except (OSError, ValueError):
            return
        self._saved_data_limit = saved

    def _unlimit_host(self) -> None:
        self._host_limit = self._host_room = None
        if self._ops is not None:
            self._ops.limit(None)
        saved, self._saved_data_limit = self._saved_data_limit, None
        if saved is not None:
            with contextlib.suppress(OSError, ValueError):
                resource.setrlimit(resource.RLIMIT_DATA, saved)

    def total_memory(self) -> int | None:
        return self.capacity

    def device_total(self) -> int:
        """The device size ``torch.cuda`` reports: the capacity, or :data:`UNLIMITED_TOTAL`."""
        return self.capacity if self.capacity is not None else UNLIMITED_TOTAL

    def own_memory(self, held: list[torch.Tensor], *, fixtures: bool) -> None:
        """Before the next test begins: its fixtures that were made before it hold ``held``
        (a tensor per storage), and ``fixtures`` says whether it has broader-scoped fixtures
        at all. Its reserved figures (:meth:`own_reserved`) count those and its own
        allocations, on segments of their own."""
        self._next_own = (held, fixtures)

    def begin_test(self) -> None:
        if self._active:
            return
        held, fixtures = self._next_own or ([], False)
        self._next_own = None
        self._counters_at_start = (self.segments.num_ooms, self.segments.num_alloc_retries)
        # The dispatch mode first: entering FakeTensorMode reads torch.cuda.is_available(),
        # which must be the real answer.
        computing = self.computing
        # A capacity needs its out-of-memory at the allocation, which only the tracker, which
        # asks the segments at each allocation, can raise; listeners hear from the tracker.
        # The op counter's segments are the test's own only when they start empty, and its
        # fixtures' storages could not be laid out on them anew: the tracker counts then.
        # The op counter sees no op in Python, so no matrix multiply that needs a workspace.
        native = (
            computing
            and self.capacity is None
            and not self.workspaces.size
            and not self.tracker.listeners
            and not fixtures
            and self._op_counter() is not None
            and self._ops.segments().reserved == 0  # type: ignore[union-attr]
        )
        mode: Any = None if native else self.tracker.mode if computing else self.fake_mode
        self._native = native
        if computing:
            self._limit_host()
        try:
            if native:
                assert self._ops is not None
                self._ops.watch()
            else:
                mode.__enter__()
        except BaseException:
            self._native = False
            self._unlimit_host()
            raise
        try:
            self.cuda.install(computing=computing)
        except BaseException:
            self._stop_counting(mode)
            raise
        self.tracker.flush()  # what died before the test is not its own
        self.own_segments.start(self._allocations_of(held))
        self._own_ops = native
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
        self.own_segments.stop()
        self._own_ops = False
        try:
            if self._native:
                assert self._ops is not None
                self._ops.unwatch()
                self._native = False
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
        ops = self._ops
        return self.tracker.current + (ops.current if ops is not None else 0)

    def peak_allocated(self) -> int:
        ops = self._ops
        return self.tracker.peak + (ops.peak if ops is not None else 0)

    def reset_peak(self) -> None:
        self.tracker.reset_peak()
        self.segments.reset_peak()
        own = self.own_segments.model
        if own is not None:
            own.reset_peak()
        if self._ops is not None:
            self._ops.reset_peak()
            self._ops.reset_segment_peaks()

    def storage_bytes(self, tensor: torch.Tensor) -> int | None:
        if not (self.counted(tensor) if self.computing else _on_device(tensor)):
            return None
        return round_like_cuda_allocator(tensor.untyped_storage().nbytes())

    def reserved(self) -> int | None:
        return self._segments().reserved

    def peak_reserved(self) -> int | None:
        return self._segments().peak_reserved

    # The test's own reserved memory: its figures do not depend on what else is alive.

    def own_reserved(self) -> int | None:
        """The bytes of the segments the running test's own memory needs (see
        :class:`~pytest_vram.backends.segments.OwnSegments`); between tests, :meth:`reserved`."""
        own = self._own_figures()
        return self.reserved() if own is None else own.reserved

    def own_peak_reserved(self) -> int | None:
        own = self._own_figures()
        return self.peak_reserved() if own is None else own.peak_reserved

    def _own_figures(self) -> SegmentFigures | None:
        model = self.own_segments.model
        if model is None:
            return None
        self.tracker.flush()
        figures = model.figures()
        if not self._own_ops:
            return figures
        assert self._ops is not None
        return SegmentFigures(*map(sum, zip(figures, self._ops.segments(), strict=True)))

    def restart_own(self) -> None:
        """A broader-scoped fixture was made: the test's own segments start again from what
        is live, as in a later test that finds it made."""
        self.tracker.flush()
        self.own_segments.restart()

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
        self.tracker.flush()

    def release_cache(self) -> None:
        # As the per-test clean-up on cuda: the workspaces go, then the cache.
        self.workspaces.clear()
        self.tracker.flush()
        self.segments.empty_cache()
        own = self.own_segments.model
        if own is not None:
            own.empty_cache()
        if self._ops is not None:
            self._ops.empty_cache()

    def counters(self) -> dict[str, int]:
        ooms, retries = self._counters_at_start
        self.tracker.flush()
        own = self.own_segments.model
        if own is None:
            inactive = self._inactive_split_bytes()
        else:  # the test's own, as its reserved figures are
            inactive = own.inactive_split_bytes()
            if self._own_ops:
                assert self._ops is not None
                inactive += self._ops.inactive_split_bytes()
        return {
            "num_ooms": self.segments.num_ooms - ooms,
            "num_alloc_retries": self.segments.num_alloc_retries - retries,
            "inactive_split_bytes": inactive,
        }

    def memory_stats_nested(self) -> dict[str, Any]:
        """``torch.cuda.memory_stats_as_nested_dict()`` of the simulated device."""
        allocated, peak = self.allocated(), self.peak_allocated()
        seg, ooms = self._segments(), self.segments

        def stat(current: int, peak: int | None = None) -> dict[str, dict[str, int]]:
            return {"all": {"current": current, "peak": current if peak is None else peak}}

        return {
            "allocated_bytes": stat(allocated, peak),
            "active_bytes": stat(allocated, peak),
            "reserved_bytes": stat(seg.reserved, seg.peak_reserved),
            "inactive_split_bytes": stat(self._inactive_split_bytes()),
            "segment": stat(seg.segments),
            "num_alloc_retries": ooms.num_alloc_retries,
            "num_ooms": ooms.num_ooms,
            "num_device_alloc": seg.num_device_alloc,
            "num_device_free": seg.num_device_free,
        }

    def memory_summary(self) -> str:
        allocated, peak = self.allocated(), self.peak_allocated()
        seg, ooms = self._segments(), self.segments
        capacity = "unlimited" if self.capacity is None else format_size(self.capacity)
        return "\n".join(
            [
                "pytest-vram simulated CUDA device (sim backend)",
                f"  allocated: {format_size(allocated)} (peak {format_size(peak)})",
                f"  reserved:  {format_size(seg.reserved)} (peak {format_size(seg.peak_reserved)})"
                f" in {seg.segments} segments",
                f"  cached, not allocated: {format_size(seg.reserved - seg.allocated)}"
                f" ({format_size(self._inactive_split_bytes())} in partly used segments)",
                f"  capacity: {capacity}",
                f"  out-of-memory errors: {ooms.num_ooms}, allocator retries: "
                f"{ooms.num_alloc_retries}",
            ]
        )

    def explain_error(self, exc: BaseException) -> str | None:
        if self.computing:
            if isinstance(exc, HostMemoryExceeded) or _HOST_MESSAGE_START in str(exc):
                return None  # its message says it all
            if isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc):
                return self._host_message(None)
            return None
        cause = needs_values_error(exc)
        if cause is None:
            return None
        func = getattr(cause, "func", None)
        if isinstance(cause, DynamicOutputShapeException):
            what = f"an op whose output shape depends on tensor values ({func})"
        else:
            what = (
                f"a tensor's value ({func}: .item(), .tolist(), bool(tensor) or a Python branch "
                "on a tensor)"
            )
        location = _user_location(exc) or _user_location(cause)
        where = f" at {location}" if location else ""
        return (
            f"the simulated device computes no values, and this test needs {what}{where}. "
            "Shape-only, the sim backend's tensors are fake: they carry shapes, dtypes and "
            "memory but no data. With --vram-sim-compute=auto (the default) such a test runs "
            "again computing its values on the CPU, with the same figures; or run it on a "
            'device that computes, with @pytest.mark.vram_backend("cpu") (or "cuda" on a GPU '
            "runner)."
        )

    def environment(self) -> dict[str, Any]:
        env = super().environment()
        env["sim_capacity"] = self.capacity
        env["sim_gpu"] = self.gpu.name
        return env

    def close(self) -> None:
        self.end_test()
