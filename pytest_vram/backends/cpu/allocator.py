"""Count the bytes PyTorch's CPU allocator hands out, from inside the allocator.

``allocator.cpp`` wraps the CPU allocator with one that counts, per watched thread, the bytes
of the blocks it hands out and frees, with their peak. Counting there costs a few atomic adds per
allocation, where watching every op from Python (a ``TorchDispatchMode``) costs microseconds per
op; it also sees what kernels allocate for themselves, as the CUDA allocator's figures do.

:mod:`pytest_vram.backends.cpu.build` builds, caches and checks the library; :func:`load`
installs it, once a process, and the counters here read it. Where it cannot be built or
loaded, :func:`load` raises :class:`CounterUnavailable` with the reason, and the cpu backend
falls back to counting from Python.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
from collections.abc import Iterator

from pytest_vram.backends.cpu import build
from pytest_vram.backends.cpu.build import CounterUnavailable, open_library
from pytest_vram.backends.segments import SegmentFigures

__all__ = ["AllocatorCounter", "CounterUnavailable", "OpCounter", "load", "notes"]

_library: ctypes.CDLL | None = None
# The build's note (a cache not used) as it stood for the library load() installed.
_loaded_note: str | None = None


def notes() -> list[str]:
    """What the user should know about the installed counter's library (a cache not used)."""
    return [_loaded_note] if _loaded_note else []


def load() -> ctypes.CDLL:
    """The counting allocator's library, installed as PyTorch's CPU allocator (once a process)."""
    global _library, _loaded_note
    if _library is not None:
        return _library
    library, target = open_library()
    handle = ctypes.c_void_p
    pointers = ctypes.POINTER(ctypes.c_void_p)
    for name, restype, argtypes in [
        ("pytest_vram_install", ctypes.c_int, []),
        ("pytest_vram_installed", ctypes.c_int, []),
        ("pytest_vram_new_counter", handle, []),
        ("pytest_vram_watch", ctypes.c_int, [handle]),
        ("pytest_vram_unwatch", None, [handle]),
        ("pytest_vram_counter_layout", ctypes.c_int, []),
        ("pytest_vram_reset_peak", None, [handle]),
        ("pytest_vram_log_release", None, [handle]),
        ("pytest_vram_log_length", ctypes.c_int64, [handle]),
        ("pytest_vram_log_peak_from_here", None, [handle]),
        ("pytest_vram_log_tag", ctypes.c_int64, [handle, handle]),
        ("pytest_vram_log_peak_blocks", None, [handle, handle, ctypes.c_int64]),
        # Called with the counter's own c_void_p: no argument to convert.
        ("pytest_vram_log_peak", ctypes.c_int64, None),
        ("pytest_vram_counted_bytes", ctypes.c_int64, [handle, handle]),
        ("pytest_vram_log_event", None, [handle, handle, ctypes.c_int64]),
        ("pytest_vram_new_op_counter", handle, []),
        ("pytest_vram_op_watch", ctypes.c_int, [handle]),
        ("pytest_vram_op_unwatch", None, [handle]),
        ("pytest_vram_op_reset_peak", None, [handle]),
        ("pytest_vram_op_uncounted", None, [ctypes.c_int]),
        ("pytest_vram_op_enter", None, []),
        ("pytest_vram_op_leave", None, []),
        ("pytest_vram_op_limit", None, [handle, ctypes.c_int64, ctypes.c_char_p, ctypes.c_char_p]),
        ("pytest_vram_op_segments", None, [handle, ctypes.POINTER(ctypes.c_int64), ctypes.c_int]),
        ("pytest_vram_op_empty_cache", ctypes.c_int64, [handle]),
        ("pytest_vram_op_reset_segment_peaks", None, [handle]),
        ("pytest_vram_op_inactive_split_bytes", ctypes.c_int64, [handle]),
        ("pytest_vram_op_counts", ctypes.c_int, [handle, handle]),
        ("pytest_vram_op_forget", ctypes.c_int, [handle, handle]),
        ("pytest_vram_op_log", None, [handle, handle, ctypes.c_int64]),
        ("pytest_vram_op_has_workspace", ctypes.c_int, [handle, ctypes.c_int]),
        ("pytest_vram_op_blocks", ctypes.c_int64, [handle]),
        ("pytest_vram_op_workspace_size", None, [handle, ctypes.c_int64]),
        ("pytest_vram_op_clear_workspaces", ctypes.c_int, [handle]),
        ("pytest_vram_op_relayout", None, [handle]),
        ("pytest_vram_op_start_own", None, [handle, pointers, ctypes.c_int64]),
        ("pytest_vram_cuda_guard", ctypes.c_int, [ctypes.c_int]),
    ]:
        try:
            function = getattr(library, name)
        except AttributeError:
            raise CounterUnavailable(f"{target} is not pytest-vram's counter: no {name}") from None
        function.restype = restype
        function.argtypes = argtypes
    if library.pytest_vram_counter_layout() != 0:
        raise CounterUnavailable(f"{target} lays its counters out unlike this module reads them")
    if library.pytest_vram_install() != 0:
        raise CounterUnavailable(
            "another CPU allocator was installed with a higher priority; it is left in place"
        )
    _library, _loaded_note = library, build._cache_note
    return library


# Blocks alive at a log's peak read into one buffer kept for it, and how long a log may be for its
# memory to be kept until the next start (24 bytes an event, and its tag's).
_BLOCKS_READ = 256
_EVENTS_KEPT = 1 << 16
_LOG_STARTING = 2
#: Where codes below this have their bytes at the peak kept as the log grows (kPlaces).
LOG_PLACES = 16


class _ReadInPlace:
    """A counter of the library's whose current and peak bytes Python reads straight from its
    memory (offsets 0 and 8): a ctypes call per read would cost a microsecond, several per
    test."""

    _library: ctypes.CDLL

    def _open(self, address: int) -> None:
        self._handle = ctypes.c_void_p(address)
        self._current = ctypes.c_int64.from_address(address)
        self._peak = ctypes.c_int64.from_address(address + 8)
        #: :attr:`current` and :attr:`peak` as calls that run no Python code: a backend reads
        #: them several times a test.
        self.read_current = functools.partial(getattr, self._current, "value")
        self.read_peak = functools.partial(getattr, self._peak, "value")

    def _check_installed(self) -> None:
        if not self._library.pytest_vram_installed():
            raise CounterUnavailable(
                "PyTorch's CPU allocator was replaced after pytest-vram installed its counter"
            )

    @property
    def current(self) -> int:
        return self._current.value

    @property
    def peak(self) -> int:
        return self._peak.value


class AllocatorCounter(_ReadInPlace):
    """Bytes of the CPU blocks allocated on the watching thread and still alive, and their peak.

    :meth:`watch` counts the calling thread's allocations from then on, until :meth:`unwatch`;
    frees of counted blocks are counted on any thread, watched or not. Several counters may
    watch at once (up to four), each with its own figures.
    """

    name = "allocator"

    def __init__(self) -> None:
        self._library = load()
        address = self._library.pytest_vram_new_counter()
        self._open(address)
        #: Where the watched thread is, a code logged with each allocation: written in place.
        self.where = ctypes.c_int64.from_address(address + 24)
        self._logged = ctypes.c_int64.from_address(address + 32)
        self._logging = ctypes.c_int64.from_address(address + 40)
        self._peak_by_where = (ctypes.c_int64 * LOG_PLACES).from_address(address + 48)
        self._peak_blocks(_BLOCKS_READ)

    def watch(self) -> None:
        self._check_installed()
        if self._library.pytest_vram_watch(self._handle) != 0:
            raise CounterUnavailable("four counters already watch CPU allocations")

    def unwatch(self) -> None:
        self._library.pytest_vram_unwatch(self._handle)

    def __del__(self) -> None:
        # A counter nobody can read any more must not hold one of the four watching slots.
        with contextlib.suppress(Exception):
            self.unwatch()

    def reset_peak(self) -> None:
        # Written in place, as it is read: only the watched thread raises the peak, and it is
        # running this.
        self._peak.value = self._current.value

    # -- the log a breakdown replays ------------------------------------------------------

    def start_log(self) -> None:
        """Log every counted allocation and free from now on, on an empty log."""
        # In place, as the figures are read: the library empties the log at its next event.
        self._logged.value = 0
        self._logging.value = _LOG_STARTING

    def stop_log(self) -> None:
        """Stop logging; a long log's memory is let go."""
        if self._logged.value <= _EVENTS_KEPT:
            self._logging.value = 0  # the memory of a short log waits for the next start
        else:
            self._library.pytest_vram_log_release(self._handle)

    def log_length(self) -> int:
        """How many events the log holds."""
        return self._library.pytest_vram_log_length(self._handle)

    def log_tag(self, data_ptr: int) -> int:
        """The log's tag of the counted block at ``data_ptr``, 0 when none is counted there. A
        block counted before the log began (a negative tag) is alive from the log's start until
        the log frees it."""
        return self._library.pytest_vram_log_tag(self._handle, data_ptr)

    def log_peak_from_here(self) -> None:
        """Look for the log's peak from the next event on."""
        self._library.pytest_vram_log_peak_from_here(self._handle)

    def log_peak_by_where(self, codes: int = LOG_PLACES) -> list[int]:
        """The bytes alive at the log's peak by where code, for the codes below ``codes`` (at
        most :data:`LOG_PLACES`), of the blocks allocated in the log."""
        if not self._logged.value:  # nothing logged since the start: the figures are stale
            return [0] * codes
        return self._peak_by_where[:codes]

    def log_peak(self) -> list[int]:
        """The blocks alive at the log's peak, flat: the tag, bytes and where code of each;
        where is 0 (unknown) for a block counted before the log began."""
        count = self._library.pytest_vram_log_peak(self._handle)
        if count > self._capacity:
            self._peak_blocks(count)
            count = self._library.pytest_vram_log_peak(self._handle)
        return self._blocks[: 3 * min(count, self._capacity)]

    def _peak_blocks(self, capacity: int) -> None:
        self._blocks = (ctypes.c_int64 * (3 * capacity))()
        self._capacity = capacity
        self._library.pytest_vram_log_peak_blocks(self._handle, self._blocks, capacity)

    def counted_bytes(self, data_ptr: int) -> int:
        """The bytes counted for the block at ``data_ptr``: 0 when this counter counts none."""
        return self._library.pytest_vram_counted_bytes(self._handle, data_ptr)

    def log_event(self, key: int, nbytes: int) -> None:
        """Log an allocation of ``nbytes`` (a free, negative) that is counted elsewhere, at
        ``key``: a number no block's data pointer can be (at or above ``1 << 62``)."""
        self._library.pytest_vram_log_event(self._handle, key, nbytes)


class OpCounter(_ReadInPlace):
    """Bytes of what ops return on the watching thread and still alive, rounded as the CUDA
    caching allocator rounds them, and their peak: the simulated device's count of a test that
    computes on the CPU.

    A block allocated while an op runs counts once the outermost op that reaches a kernel has
    returned, if it is still alive; what a kernel allocates and frees again never counts. That
    is what a ``TorchDispatchMode`` sees of each op's outputs, for a RecordFunction callback in
    C++ per op. Each counted block and its free are replayed, as they happen, on a model of
    the CUDA caching allocator's segments: the one of
    :class:`~pytest_vram.backends.segments.CachingAllocatorModel`, without a capacity, whose
    figures :meth:`segments` reads.
    """

    def __init__(self) -> None:
        self._library = library = load()
        self._open(library.pytest_vram_new_op_counter())
        self._uncounted = library.pytest_vram_op_uncounted
        self._figures = (ctypes.c_int64 * len(SegmentFigures._fields))()

    def watch(self) -> None:
        """Count the calling thread's op outputs from now on."""
        self._check_installed()
        if self._library.pytest_vram_op_watch(self._handle) != 0:
            raise CounterUnavailable("another op counter watches this thread")

    def unwatch(self) -> None:
        self._library.pytest_vram_op_unwatch(self._handle)

    def reset_peak(self) -> None:
        self._library.pytest_vram_op_reset_peak(self._handle)

    def limit(self, nbytes: int | None, head: str = "", tail: str = "") -> None:
        """Refuse an allocation that would take :attr:`current` past ``nbytes`` (None: no
        limit) with ``torch.OutOfMemoryError``: ``head``, the bytes that would be live, ``tail``."""
        self._library.pytest_vram_op_limit(
            self._handle, -1 if nbytes is None else nbytes, head.encode(), tail.encode()
        )

    @contextlib.contextmanager
    def uncounted(self) -> Iterator[None]:
        """Allocations of the calling thread inside are not counted."""
        self._uncounted(1)
        try:
            yield
        finally:
            self._uncounted(-1)

    @contextlib.contextmanager
    def as_one_op(self) -> Iterator[None]:
        """What the calling thread allocates inside counts as one op's outputs would."""
        self._library.pytest_vram_op_enter()
        try:
            yield
        finally:
            self._library.pytest_vram_op_leave()

    def counts(self, data_ptr: int) -> bool:
        """Whether the block at ``data_ptr`` is counted, now or when the op that makes it
        returns."""
        return bool(self._library.pytest_vram_op_counts(self._handle, data_ptr))

    def forget(self, data_ptr: int) -> bool:
        """Count the block at ``data_ptr`` no more, from now to its free; whether it was
        counted."""
        return bool(self._library.pytest_vram_op_forget(self._handle, data_ptr))

    def log_to(self, counter: AllocatorCounter | None, workspace_where: int = 0) -> None:
        """From now on log each block counted and freed on ``counter``'s log (a counter that
        does not watch; None: no log), a cuBLAS workspace with where code ``workspace_where``.
        The log's tags and its replay to the peak are then of this op counter's blocks."""
        handle = counter._handle if counter is not None else None
        self._library.pytest_vram_op_log(self._handle, handle, workspace_where)

    def segments(self, background: bool = False) -> SegmentFigures:
        """The segment model's figures now; ``background``: those of the background model,
        where the blocks are that :meth:`start_own` left out."""
        self._library.pytest_vram_op_segments(self._handle, self._figures, int(background))
        return SegmentFigures(*self._figures)

    def inactive_split_bytes(self) -> int:
        """Cached bytes in segments that are partly in use (a walk over the cached blocks)."""
        return self._library.pytest_vram_op_inactive_split_bytes(self._handle)

    def empty_cache(self) -> int:
        """Give the entirely free segments back; the bytes released."""
        return self._library.pytest_vram_op_empty_cache(self._handle)

    def reset_segment_peaks(self) -> None:
        self._library.pytest_vram_op_reset_segment_peaks(self._handle)

    def workspace_size(self, nbytes: int) -> None:
        """From now on the first matrix multiply of each thread (of the autograd engine, inside
        backward) allocates a cuBLAS workspace of ``nbytes`` after its outputs, as
        :class:`~pytest_vram.backends.sim.workspaces.CublasWorkspaces` does (0: none)."""
        self._library.pytest_vram_op_workspace_size(self._handle, nbytes)

    def relayout(self) -> None:
        """Lay the live blocks out on a fresh segment model, largest first (between ops); those
        of the background model stay there."""
        self._library.pytest_vram_op_relayout(self._handle)

    def start_own(self, held: list[int]) -> None:
        """Lay the blocks at the data pointers ``held`` out on a fresh segment model, largest
        first, and move every other live block to the background model (between tests)."""
        pointers = (ctypes.c_void_p * len(held))(*held)
        self._library.pytest_vram_op_start_own(self._handle, pointers, len(held))

    def blocks(self) -> int:
        """How many blocks are counted now, the workspaces aside."""
        return self._library.pytest_vram_op_blocks(self._handle)

    def has_workspace(self, backward: bool) -> bool:
        """Whether a workspace is held for the calling thread (``backward``: for the autograd
        engine's)."""
        return bool(self._library.pytest_vram_op_has_workspace(self._handle, int(backward)))

    def clear_workspaces(self) -> int:
        """Let every workspace go; how many there were."""
        return self._library.pytest_vram_op_clear_workspaces(self._handle)
