"""Count the bytes of live tensor storages, exactly, by watching every dispatched op.

The sim backend and the cpu backend's dispatch counter share this: a ``TorchDispatchMode``
(``StorageTracker.mode``, or the sim backend's FakeTensorMode, which calls ``observe_output``
itself) hands over each op's outputs; the tracker registers each storage it has not seen (views
share one storage, so they count once), re-reads the size of storages it knows (``resize_``,
``set_`` and ``out=`` ops return the tensor they changed), and a small record kept in the
storage's own ``__dict__`` gives the bytes back when the storage dies.

PyTorch keeps a storage's Python object (and so the record) alive exactly as long as the storage,
so a freed storage is noticed the moment its last tensor goes, on whichever thread that happens.
The record only queues the release; the tracker applies queued releases before it counts the next
allocation or answers a query, so that the counts are only ever changed by one thread at a time.
"""

from __future__ import annotations

import contextlib
import itertools
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from pytest_vram.backends.dynamoskip import keep_out_of_dynamo
from pytest_vram.backends.gradsums import (
    IN_PLACE_SCATTERS,
    accumulates_in_place,
    scattered_in_place,
)
from pytest_vram.backends.wrappednumbers import numbers_as_tensors

__all__ = [
    "AllocationListener",
    "Allocator",
    "StorageTracker",
    "listen_for_fixtures",
    "making_fixture",
    "round_like_cuda_allocator",
]


def round_like_cuda_allocator(nbytes: int) -> int:
    """What the CUDA caching allocator hands out for a request: multiples of 512 bytes."""
    if nbytes <= 0:
        return 0
    return (nbytes + 511) // 512 * 512


class Allocator(Protocol):
    """Sees every allocation and free the tracker counts (the simulated device's segments).

    ``malloc`` may raise (out of memory) before the storage is counted; what it returns is
    handed back to ``free`` when the storage dies or is resized.
    """

    def malloc(self, nbytes: int) -> Any: ...

    def free(self, handle: Any) -> None: ...


class AllocationListener(Protocol):
    """Told of every allocation, resize and free the tracker counts, in order (attribution).

    ``tag`` is an int the tracker gives each storage allocated while a listener is attached (or
    adopted later through :meth:`StorageTracker.tag_of`); storages from before have None.
    """

    def allocated(self, tag: int, size: int, handle: Any) -> None: ...

    def resized(self, tag: int | None, old: int, new: int, handle: Any) -> None: ...

    def freed(self, tag: int | None, size: int, handle: Any) -> None: ...


_TRACKER_NUMBERS = itertools.count()

#: What asking a tensor for its storage raises where it has none: sparse, nested and other
#: storage-less kinds, and a lazy module's parameter before its first forward (ValueError).
_NO_STORAGE = (NotImplementedError, RuntimeError, ValueError)

#: The trackers that have listeners now, and other sources of allocations that want to hear of
#: fixtures being made (listen_for_fixtures).
_LISTENED: set[Any] = set()


def making_fixture(started: bool) -> None:
    """A broader-scoped fixture starts (True) or ends (False) being made in a measured test's
    setup. The listeners of every tracker that has some are told (``making_fixture``, where
    they have it): what is made then is the fixture's, as a later test finds it made."""
    for tracker in tuple(_LISTENED):
        tracker.making_fixture(started)


def listen_for_fixtures(source: Any, on: bool) -> None:
    """Tell ``source`` (with a ``making_fixture`` method, as a tracker has) of broader-scoped
    fixtures being made, as trackers with listeners are told, from now on (True) or no more."""
    if on:
        _LISTENED.add(source)
    else:
        _LISTENED.discard(source)


class _Record:
    """Lives in a storage's ``__dict__``; queues the storage's bytes for release when it dies."""

    __slots__ = ("handle", "released", "request", "size", "tag")

    def __init__(self, size: int, handle: Any, released: list[tuple[int, Any, Any]]) -> None:
        self.size = size
        # What the storage asked for; ``size`` is what it was handed, which may be more.
        self.request = size
        self.handle = handle
        self.released = released
        self.tag: int | None = None

    def __del__(self) -> None:
        # list.append is atomic, so this is safe on any thread and in the middle of a count.
        self.released.append((self.size, self.handle, self.tag))


# lift_fresh aliases its input by its schema, but it is how torch.tensor(data) makes a tensor.
_LIFTS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})
_ALIASING: dict[Any, bool] = {}


def _returns_alias(func: Any) -> bool:
    """Whether an output of the op aliases an input: a view, in-place or ``out=`` op."""
    try:
        return _ALIASING[func]
    except (KeyError, TypeError):
        pass
    schema = getattr(func, "_schema", None)
    aliases = (
        schema is not None
        and func not in _LIFTS
        and any(ret.alias_info is not None for ret in schema.returns)
    )
    with contextlib.suppress(TypeError):  # unhashable callables are simply not remembered
        _ALIASING[func] = aliases
    return aliases


class StorageTracker:
    """Live storage bytes, their peak, and a hook on every allocation.

    ``counts(tensor)`` decides which storages belong to the measured device, ``size_of(nbytes)``
    maps a storage's bytes to what the device would hand out (None: the bytes themselves),
    ``on_allocate(nbytes)`` runs before a new storage is counted, and ``allocator`` (optional)
    is told of every allocation and free, in order, so that it can model how the device caches
    memory; either may raise to refuse the allocation (the simulated device's out-of-memory).

    With ``count_unseen_aliases=False``, an op output that aliases one of the op's inputs (a
    view, an in-place or an ``out=`` result) never registers a storage the tracker has not
    seen: touching a tensor made before tracking began allocates nothing. The default counts
    such a storage when it first shows up, as the cpu backend always has.

    ``before_listen`` runs before a listener is added: the sim backend, which may count a test
    elsewhere, then counts it here, where listeners hear of each allocation.

    With ``adopt_unseen=True`` (a tracker that only listeners read, made for one test),
    :meth:`tag_of` also tags a storage the tracker never counted, one made before it watched:
    listeners adopt it and hear when it dies, and the counts stay as they were.
    """

    def __init__(
        self,
        counts: Callable[[torch.Tensor], bool],
        size_of: Callable[[int], int] | None = None,
        on_allocate: Callable[[int], None] | None = None,
        allocator: Allocator | None = None,
        count_unseen_aliases: bool = True,
        before_listen: Callable[[], None] | None = None,
        adopt_unseen: bool = False,
        block_size: Callable[[Any, int], int] | None = None,
    ) -> None:
        self._adopt_unseen = adopt_unseen
        # The bytes the allocator handed out for a request (its block may hold more).
        self._block_size = block_size
        # Ops after whose outputs a callback runs (the simulated device's cuBLAS workspaces).
        self._watched_ops: frozenset[Any] = frozenset()
        self._on_watched_op: Callable[[], None] | None = None
        self._counts = counts
        self._size_of = size_of
        self._on_allocate = on_allocate
        self.allocator = allocator
        # One attribute name per tracker, so that two trackers can watch the same storage; not
        # the tracker's id, which a later one may get when this one is gone.
        self._key = f"_pytest_vram_record_{next(_TRACKER_NUMBERS)}"
        self._released: list[tuple[int, Any, Any]] = []
        #: Attribution's listeners; empty (and free) unless a test asked for attribution.
        self.listeners: tuple[AllocationListener, ...] = ()
        self._next_tag = 0
        # The tag the next storage registered takes (handing_over): a copy that counts for
        # the storage it was made from.
        self._heir_tag: int | None = None
        # Tags below this one were given for listeners that are gone: to those listening now
        # such a storage is one from before, adopted when met (tag_of).
        self._first_tag = 1
        # Reentrant: an on_allocate hook may read the counts it is called from.
        self._lock = threading.RLock()
        self._current = 0
        self.peak = 0
        #: The bytes counted beside the tracker's (an op counter that a running test moved
        #: from, which still holds what it counted): its peak is then the peak of the sum.
        self.beside: Callable[[], int] | None = None
        self._register_aliases = count_unseen_aliases
        self._before_listen = before_listen
        self.mode = _TrackingMode(self)

    @property
    def current(self) -> int:
        """Bytes of the live storages counted so far."""
        self.flush()
        return self._current

    def flush(self) -> None:
        """Apply the releases of storages that died since the last count (and tell the
        allocator), so that what the allocator reports is up to date."""
        if self._released:
            with self._lock:
                self._apply_releases()

    def reset_peak(self) -> None:
        with self._lock:
            self._apply_releases()
            self.peak = self._current if self.beside is None else self._current + self.beside()

    def add_listener(self, listener: AllocationListener) -> None:
        if self._before_listen is not None:
            self._before_listen()
        with self._lock:
            self._apply_releases()  # frees from before belong to no listener
            if not self.listeners:
                self._first_tag = self._next_tag + 1
            self.listeners = (*self.listeners, listener)
            _LISTENED.add(self)

    def remove_listener(self, listener: AllocationListener) -> None:
        with self._lock:
            self._apply_releases()
            self.listeners = tuple(x for x in self.listeners if x is not listener)
            if not self.listeners:
                _LISTENED.discard(self)

    def making_fixture(self, started: bool) -> None:
        """See :func:`making_fixture`."""
        with self._lock:
            self._apply_releases()  # what died before belongs before
            for listener in self.listeners:
                told = getattr(listener, "making_fixture", None)
                if told is not None:
                    told(started)

    def tag_of(self, tensor: torch.Tensor) -> int | None:
        """The tag of ``tensor``'s storage when the tracker counts it; a storage counted before
        the listeners now attached were (an earlier test's listeners' included) gets one now,
        and listeners learn of it as allocated before."""
        if not self._counts(tensor):
            return None
        try:
            storage = tensor.untyped_storage()
        except _NO_STORAGE:
            return None
        record = getattr(storage, self._key, None)
        size = None
        if record is None:
            if not self._adopt_unseen:
                return None
            nbytes = storage.nbytes()
            size = nbytes if self._size_of is None else self._size_of(nbytes)
            # Zero bytes: it was never counted, and its death takes nothing off the counts.
            record = _Record(0, None, self._released)
            setattr(storage, self._key, record)
        if record.tag is None or record.tag < self._first_tag:
            with self._lock:
                record.tag = tag = self._new_tag()
                for listener in self.listeners:
                    adopt = getattr(listener, "adopted", None)
                    if adopt is not None:
                        adopt(tag, record.size if size is None else size, record.handle)
        return record.tag

    def _new_tag(self) -> int:
        self._next_tag += 1
        return self._next_tag

    def observe(self, tensor: torch.Tensor, register: bool = True) -> None:
        """Count ``tensor``'s storage if it is new, or its new size if it was resized.

        With ``register=False`` only storages already counted are looked at (for resizes).
        """
        if not self._counts(tensor):
            return
        try:
            storage = tensor.untyped_storage()
        except _NO_STORAGE:
            return
        record = getattr(storage, self._key, None)
        if record is None and not register:
            return
        size = storage.nbytes() if self._size_of is None else self._size_of(storage.nbytes())
        if record is not None and record.request == size:
            return
        with self._lock:
            if self._released:
                self._apply_releases()
            if record is None:
                self._register(storage, size)
            else:
                self._resize(record, size)

    def observe_resize(self, storage: torch.UntypedStorage) -> None:
        """Count the new size of a counted storage that ``UntypedStorage.resize_`` changed
        without dispatching an op (FSDP frees and refills its unsharded parameters so)."""
        record = getattr(storage, self._key, None)
        if record is None:
            return
        nbytes = storage.nbytes()
        size = nbytes if self._size_of is None else self._size_of(nbytes)
        if record.request != size:
            with self._lock:
                self._apply_releases()
                self._resize(record, size)

    def counted(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s storage is one of the live storages counted."""
        try:
            return hasattr(tensor.untyped_storage(), self._key)
        except _NO_STORAGE:
            return False

    @contextlib.contextmanager
    def handing_over(self, tensor: torch.Tensor) -> Iterator[bool]:
        """Count ``tensor``'s storage no more, as if it had died: the next storage counted
        inside, its copy, counts its bytes now and takes its tag, so that listeners know it as
        the same memory. Yields whether the storage was counted. With
        ``count_unseen_aliases=False`` no alias of it is counted again."""
        try:
            storage = tensor.untyped_storage()
        except _NO_STORAGE:
            storage = None
        record = getattr(storage, self._key, None) if storage is not None else None
        if record is None:
            yield False
            return
        delattr(storage, self._key)
        self._heir_tag = record.tag
        # Its record dies here and queues the release, as the storage's own death would.
        del record
        try:
            yield True
        finally:
            self._heir_tag = None

    def allocation_of(self, tensor: torch.Tensor) -> tuple[Any, int] | None:
        """The allocator's handle for ``tensor``'s storage and the bytes it asked for; None
        when the storage is not one the tracker counts."""
        try:
            record = getattr(tensor.untyped_storage(), self._key, None)
        except _NO_STORAGE:
            return None
        return None if record is None else (record.handle, record.request)

    def observe_output(self, func: Any, out: Any) -> None:
        """Count what the op ``func`` returned (a tensor, a list or tuple of them, or neither)."""
        register = self._register_aliases or not _returns_alias(func)
        # Most ops return one tensor; queries such as prim.device return no tensor at all.
        if isinstance(out, torch.Tensor):
            self.observe(out, register)
        elif isinstance(out, (tuple, list)):
            self.observe_all(out, register)
        if func in self._watched_ops:
            self._on_watched_op()  # type: ignore[misc]

    def watch_ops(self, ops: frozenset[Any], callback: Callable[[], None] | None) -> None:
        """Run ``callback`` after the outputs of each of ``ops`` are counted."""
        self._watched_ops = ops if callback is not None else frozenset()
        self._on_watched_op = callback

    def name_storage(self, tensor: torch.Tensor, name: str) -> None:
        """Tell the listeners that have ``named`` what ``tensor``'s storage is for (memory
        that belongs to no module, such as a library's workspace)."""
        if not self.listeners:
            return
        tag = self.tag_of(tensor)
        if tag is None:
            return
        for listener in self.listeners:
            named = getattr(listener, "named", None)
            if named is not None:
                named(tag, name)

    def observe_all(self, tree: Any, register: bool = True) -> None:
        if isinstance(tree, torch.Tensor):
            self.observe(tree, register)
        elif isinstance(tree, (tuple, list)):
            for leaf in tree:
                self.observe_all(leaf, register)
        elif isinstance(tree, dict):
            for leaf in tree.values():
                self.observe_all(leaf, register)

    def _register(self, storage: torch.UntypedStorage, size: int) -> None:
        if self._on_allocate is not None:
            self._on_allocate(size)
        handle = self.allocator.malloc(size) if self.allocator is not None else None
        request = size
        if self._block_size is not None:
            size = self._block_size(handle, size)
        record = _Record(size, handle, self._released)
        record.request = request
        setattr(storage, self._key, record)
        self._add(size)
        if self.listeners:
            tag, self._heir_tag = self._heir_tag, None
            if tag is None or tag < self._first_tag:
                tag = self._new_tag()
            record.tag = tag
            for listener in self.listeners:
                listener.allocated(tag, size, handle)

    def _resize(self, record: _Record, size: int) -> None:
        if size > record.size and self._on_allocate is not None:
            self._on_allocate(size - record.size)
        record.request = size
        if self.allocator is not None:
            # A resize allocates the new size before it lets go of the old one.
            handle = self.allocator.malloc(size)
            self.allocator.free(record.handle)
            record.handle = handle
            if self._block_size is not None:
                size = self._block_size(handle, size)
        self._add(size - record.size)
        for listener in self.listeners:
            listener.resized(record.tag, record.size, size, record.handle)
        record.size = size

    def _add(self, nbytes: int) -> None:
        self._current += nbytes
        now = self._current if self.beside is None else self._current + self.beside()
        if now > self.peak:
            self.peak = now

    def _apply_releases(self) -> None:
        released = self._released
        allocator = self.allocator
        listeners = self.listeners
        while released:
            size, handle, tag = released.pop()
            self._current -= size
            if allocator is not None:
                allocator.free(handle)
            for listener in listeners:
                listener.freed(tag, size, handle)


_ADD = torch.ops.aten.add.Tensor
_ADD_IN_PLACE = torch.ops.aten.add_.Tensor


class _TrackingMode(TorchDispatchMode):
    # torch wraps every mode's __torch_dispatch__ so that its first call imports torch._dynamo
    # (over a second); this mode compiles nothing and opts out, as torch's docstring describes.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    # Dynamo runs every frame uncompiled while a mode that does not say this is active, so a
    # test that checks what torch.compile made (graphs, breaks, guards) would see nothing. What
    # the compiled code runs through the dispatcher is still counted here.
    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker
        self._observe_output = tracker.observe_output

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is _ADD and accumulates_in_place(func, args, kwargs, sys._getframe(1)):
            # The engine's gradient sum, in place as it is when no record holds the storage.
            func = _ADD_IN_PLACE
        elif func in IN_PLACE_SCATTERS:
            # A derivative formula filling its fresh zeros, in place as without a mode.
            func = scattered_in_place(func, sys._getframe(1)) or func
        # func._op skips OpOverload.__call__'s Python frame: this runs for every op.
        try:
            out = func._op(*args, **kwargs) if kwargs else func._op(*args)
        except RuntimeError as exc:
            # A wrapped number handed over as a Python number, refused before the op ran.
            retried = numbers_as_tensors(func, args, kwargs or {}, exc)
            if retried is None:
                raise
            out = func._op(*retried[0], **retried[1])
        self._observe_output(func, out)
        return out


keep_out_of_dynamo(_TrackingMode.__torch_dispatch__)
