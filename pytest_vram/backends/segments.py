"""A model of the CUDA caching allocator's segments: what ``torch.cuda.memory_reserved`` reports.

PyTorch never hands a tensor its own ``cudaMalloc``. It asks the driver for segments and carves
blocks out of them, keeping freed blocks cached for reuse. This module replays that policy, as
``c10/cuda/CUDACachingAllocator.cpp`` implements it with the default configuration, on sizes only:

- a request is rounded up to a multiple of 512 bytes;
- requests up to 1 MiB come from the small pool, whose segments are 2 MiB; larger ones from the
  large pool, whose segments are 20 MiB for requests under 10 MiB and the request rounded up to
  2 MiB otherwise;
- a request takes the smallest cached block of its pool that fits (the oldest segment first on a
  tie) and splits off the rest when at least 512 bytes (small pool) or more than 1 MiB (large
  pool) remain; otherwise it takes the whole block;
- a freed block merges with free neighbours of its segment and stays cached; ``empty_cache``
  returns segments that are entirely free to the driver;
- when a new segment would not fit in the device, every cached segment is returned and the
  request retried once before it fails with ``torch.OutOfMemoryError``.

One stream, no ``expandable_segments``, no ``max_split_size_mb``, no CUDA graph pools.
"""

from __future__ import annotations

import itertools
from bisect import bisect_left, insort
from collections.abc import Callable
from typing import NamedTuple

import torch

__all__ = [
    "Block",
    "CachingAllocatorModel",
    "OwnSegments",
    "SegmentFigures",
    "format_cuda_size",
    "segment_size_for",
]

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20  # requests up to this size use the small pool
SMALL_SEGMENT = 2 << 20
MIN_LARGE_ALLOC = 10 << 20  # large requests below this size get a 20 MiB segment
LARGE_SEGMENT = 20 << 20
ROUND_LARGE = 2 << 20
_ADDRESS_MASK = (1 << 64) - 1


def round_request(nbytes: int) -> int:
    """The block size a request of ``nbytes`` needs: at least 512, a multiple of 512."""
    if nbytes < MIN_BLOCK:
        return MIN_BLOCK
    return (nbytes + MIN_BLOCK - 1) // MIN_BLOCK * MIN_BLOCK


def segment_size_for(size: int) -> int:
    """The size of the segment the allocator asks the driver for when no cached block fits."""
    if size <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if size < MIN_LARGE_ALLOC:
        return LARGE_SEGMENT
    return (size + ROUND_LARGE - 1) // ROUND_LARGE * ROUND_LARGE


def format_cuda_size(nbytes: int) -> str:
    """Sizes as the CUDA caching allocator prints them in its messages."""
    if nbytes <= 1024:
        return f"{nbytes} bytes"
    if nbytes <= 1 << 20:
        return f"{nbytes / 1024:.2f} KiB"
    if nbytes <= 1 << 30:
        return f"{nbytes / (1 << 20):.2f} MiB"
    return f"{nbytes / (1 << 30):.2f} GiB"


class Block:
    """A contiguous range of one segment, either handed out or cached."""

    __slots__ = ("addr", "allocated", "next", "prev", "size", "small")

    def __init__(self, addr: int, size: int, small: bool) -> None:
        self.addr = addr
        self.size = size
        self.small = small
        self.allocated = False
        self.prev: Block | None = None
        self.next: Block | None = None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else "free"
        return f"Block(addr={self.addr:#x}, size={self.size}, {state})"


class _Pool:
    """Free blocks ordered by (size, address), for a best-fit search in O(log n).

    The order is kept as one int per block, ``size << 64 | address``: ints compare faster than
    tuples and, unlike tuples, are not objects the garbage collector has to visit.
    """

    __slots__ = ("blocks", "keys")

    def __init__(self) -> None:
        self.keys: list[int] = []
        self.blocks: dict[int, Block] = {}

    def add(self, block: Block) -> None:
        insort(self.keys, block.size << 64 | block.addr)
        self.blocks[block.addr] = block

    def remove(self, block: Block) -> None:
        keys = self.keys
        del keys[bisect_left(keys, block.size << 64 | block.addr)]
        del self.blocks[block.addr]

    def best_fit(self, size: int) -> Block | None:
        keys = self.keys
        i = bisect_left(keys, size << 64)
        if i == len(keys):
            return None
        return self.blocks[keys[i] & _ADDRESS_MASK]


class SegmentFigures(NamedTuple):
    """A segment model's counters, each read in constant time."""

    reserved: int
    peak_reserved: int
    allocated: int
    peak_allocated: int
    segments: int
    num_device_alloc: int
    num_device_free: int


class CachingAllocatorModel:
    """Segments and blocks of one simulated CUDA device.

    ``malloc`` returns the :class:`Block` that serves a request (None for zero bytes) and
    raises ``torch.OutOfMemoryError`` when ``capacity`` is set and cannot hold the segment the
    request needs; ``free`` gives a block back. ``reserved`` is the bytes of all segments,
    ``allocated`` the bytes of the blocks in use (which, as in PyTorch, include the unsplit tail
    of a cached block reused for a slightly smaller request).
    """

    def __init__(self, capacity: int | None = None, device_index: int = 0) -> None:
        self.capacity = capacity
        self.device_index = device_index
        self._small = _Pool()
        self._large = _Pool()
        # Addresses only order blocks; segments get increasing ones, as fresh device memory does.
        self._next_addr = 1 << 32
        self.reserved = 0
        self.peak_reserved = 0
        self.allocated = 0
        self.peak_allocated = 0
        self.segments = 0
        self.num_ooms = 0
        self.num_alloc_retries = 0
        self.num_device_alloc = 0
        self.num_device_free = 0
        #: Told ``("segment_alloc" | "segment_free", address, size)`` when set (snapshots).
        self.segment_listener: Callable[[str, int, int], None] | None = None
        #: The live segments' sizes by address, for a snapshot of the allocator's state.
        self.segment_sizes: dict[int, int] = {}

    def malloc(self, nbytes: int) -> Block | None:
        if nbytes <= 0:
            return None
        size = round_request(nbytes)
        small = size <= SMALL_REQUEST
        pool = self._small if small else self._large
        block = pool.best_fit(size)
        if block is not None:
            pool.remove(block)
        else:
            block = self._new_segment(size, small)
        remaining = block.size - size
        split = remaining >= MIN_BLOCK if small else remaining > SMALL_REQUEST
        if split:
            rest = Block(block.addr + size, remaining, small)
            rest.prev = block
            rest.next = block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            block.size = size
            pool.add(rest)
        block.allocated = True
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: Block | None) -> None:
        if block is None or not block.allocated:
            return
        block.allocated = False
        self.allocated -= block.size
        pool = self._small if block.small else self._large
        prev = block.prev
        if prev is not None and not prev.allocated:
            pool.remove(prev)
            block.addr = prev.addr
            block.size += prev.size
            block.prev = prev.prev
            if prev.prev is not None:
                prev.prev.next = block
        nxt = block.next
        if nxt is not None and not nxt.allocated:
            pool.remove(nxt)
            block.size += nxt.size
            block.next = nxt.next
            if nxt.next is not None:
                nxt.next.prev = block
        pool.add(block)

    def empty_cache(self) -> int:
        """Return every entirely free segment to the driver; the bytes released."""
        released = 0
        for pool in (self._small, self._large):
            for block in [b for b in pool.blocks.values() if b.prev is None and b.next is None]:
                pool.remove(block)
                released += block.size
                self.segments -= 1
                self.num_device_free += 1
                self.segment_sizes.pop(block.addr, None)
                if self.segment_listener is not None:
                    self.segment_listener("segment_free", block.addr, block.size)
        self.reserved -= released
        return released

    def reset_peak(self) -> None:
        self.peak_reserved = self.reserved
        self.peak_allocated = self.allocated

    def cached_blocks(self) -> list[tuple[int, int]]:
        """``(address, size)`` of each cached block: the free space of the segments."""
        return [
            (block.addr, block.size)
            for pool in (self._small, self._large)
            for block in pool.blocks.values()
        ]

    def figures(self) -> SegmentFigures:
        return SegmentFigures(
            self.reserved,
            self.peak_reserved,
            self.allocated,
            self.peak_allocated,
            self.segments,
            self.num_device_alloc,
            self.num_device_free,
        )

    @property
    def cached(self) -> int:
        """Reserved bytes no tensor uses."""
        return self.reserved - self.allocated

    def inactive_split_bytes(self) -> int:
        """Cached bytes in segments that are partly in use, which ``empty_cache`` cannot free."""
        return sum(
            block.size
            for pool in (self._small, self._large)
            for block in pool.blocks.values()
            if block.prev is not None or block.next is not None
        )

    def _new_segment(self, size: int, small: bool) -> Block:
        segment = segment_size_for(size)
        if self.capacity is not None and self.reserved + segment > self.capacity:
            # PyTorch frees its whole cache and retries once before giving up.
            self.empty_cache()
            self.num_alloc_retries += 1
            if self.reserved + segment > self.capacity:
                self.num_ooms += 1
                raise torch.OutOfMemoryError(self.oom_message(segment))
        return self._add_segment(self.segment_address(segment), segment, small)

    def segment_address(self, size: int) -> int:
        """Where the driver puts a new segment of ``size`` bytes. Addresses break ties between
        cached blocks of one size, so a replay of a real trace gives the driver's own."""
        address = self._next_addr
        self._next_addr += size
        return address

    def _add_segment(self, address: int, size: int, small: bool) -> Block:
        block = Block(address, size, small)
        self.reserved += size
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved
        self.segments += 1
        self.num_device_alloc += 1
        self.segment_sizes[address] = size
        if self.segment_listener is not None:
            self.segment_listener("segment_alloc", address, size)
        return block

    def restore_segment(
        self, address: int, size: int, allocated: list[tuple[int, int]], *, small: bool
    ) -> list[Block]:
        """Add a segment as a snapshot lists it: ``allocated`` gives the ``(address, size)`` of
        each block in use, and the rest of the segment is cached. Returns the blocks in use, in
        address order, for :meth:`free`."""
        pool = self._small if small else self._large
        end = address + size
        layout: list[Block] = []
        at = address
        for addr, nbytes in sorted(allocated):
            if addr < at or nbytes <= 0 or addr + nbytes > end:
                raise ValueError(
                    f"a block of {nbytes} bytes at {addr:#x} is not free space of the segment "
                    f"of {size} bytes at {address:#x}"
                )
            if addr > at:
                layout.append(Block(at, addr - at, small))
            block = Block(addr, nbytes, small)
            block.allocated = True
            layout.append(block)
            at = addr + nbytes
        if at < end:
            layout.append(Block(at, end - at, small))
        for before, after in itertools.pairwise(layout):
            before.next, after.prev = after, before
        self._add_segment(address, size, small)
        used = [block for block in layout if block.allocated]
        for block in layout:
            if not block.allocated:
                pool.add(block)
        self.allocated += sum(block.size for block in used)
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self._next_addr = max(self._next_addr, end)
        return used

    def oom_message(self, segment: int) -> str:
        capacity = self.capacity or 0
        free = max(capacity - self.reserved, 0)
        return (
            f"CUDA out of memory. Tried to allocate {format_cuda_size(segment)}. "
            f"GPU {self.device_index} has a total capacity of {format_cuda_size(capacity)} "
            f"of which {format_cuda_size(free)} is free. Including non-PyTorch memory, this "
            f"process has {format_cuda_size(self.reserved)} memory in use. Of the allocated "
            f"memory {format_cuda_size(self.allocated)} is allocated by PyTorch, and "
            f"{format_cuda_size(self.cached)} is reserved by PyTorch but unallocated. "
            "If reserved but unallocated memory is large try setting "
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation. "
            "(pytest-vram simulated device: its capacity is set by --vram-sim-capacity.)"
        )


class OwnSegments:
    """The segments one test's own memory needs: what its reserved figures are read from.

    The device's model holds every live storage, other tests' fixtures included, and its
    cached blocks are laid out by whatever ran before: a test's allocations may fit in a
    segment that another test's fixture keeps, or need one it would not need alone. So, as
    the allocator the tracker tells, this passes every allocation and free on to ``device``
    (its blocks are the handles, its capacity raises the out-of-memory) and, while a test is
    measured (:meth:`start`), replays the test's own on a fresh model: first the storages its
    fixtures already hold, largest first, an order that does not depend on which test made
    them, then what the test allocates and frees.
    """

    def __init__(self, device: CachingAllocatorModel) -> None:
        self.device = device
        #: The running test's model; None between measured tests.
        self.model: CachingAllocatorModel | None = None
        # By the device's block: the test's block for the same storage, and its request.
        self._twins: dict[Block, tuple[Block | None, int]] = {}
        # Requests held without a device block this model sees freed (counted elsewhere).
        self._kept: list[int] = []

    def malloc(self, nbytes: int) -> Block | None:
        block = self.device.malloc(nbytes)
        model = self.model
        if model is not None and block is not None:
            try:
                twin = model.malloc(nbytes)
            except BaseException:  # the test's own capacity (vram.max_size) refused it
                self.device.free(block)
                raise
            self._twins[block] = (twin, nbytes)
        return block

    def free(self, block: Block | None) -> None:
        self.device.free(block)
        if self._twins:
            twin = self._twins.pop(block, None)  # type: ignore[arg-type]
            if twin is not None and self.model is not None:
                self.model.free(twin[0])

    def handed_out(self, block: Block | None, nbytes: int) -> int:
        """The bytes the allocator hands out for the request of ``nbytes`` that ``block``
        serves, as CUDA counts them allocated: the test's own block while a test is measured
        (a remainder too small to split off included), else the device's."""
        twin = self._twins.get(block) if block is not None else None  # type: ignore[call-overload]
        if twin is not None and twin[0] is not None:
            return twin[0].size
        return block.size if block is not None else nbytes

    def start(self, held: list[tuple[Block | None, int]]) -> None:
        """A fresh model for a test whose fixtures hold ``held``: per storage, its device
        block (None where frees of it are not seen here) and its size."""
        model = self.model = CachingAllocatorModel()
        twins: dict[Block, tuple[Block | None, int]] = {}
        kept = []
        # Sorted by size alone: equal requests lay a fresh model out alike, in any order.
        for block, nbytes in sorted(held, key=_request_size, reverse=True):
            twin = model.malloc(nbytes)
            if block is None:
                kept.append(nbytes)
            else:
                twins[block] = (twin, nbytes)
        self._twins = twins
        self._kept = kept

    def restart(self) -> None:
        """Start again from what is live now: a broader-scoped fixture was made, and what
        making it cost, cached blocks included, is forgotten as a later test never sees it."""
        if self.model is None:
            return
        live = [(block, nbytes) for block, (_, nbytes) in self._twins.items()]
        self.start(live + [(None, nbytes) for nbytes in self._kept])

    def stop(self) -> None:
        self.model = None
        self._twins = {}
        self._kept = []


def _request_size(held: tuple[Block | None, int]) -> int:
    return held[1]
