"""The segment model replays the CUDA caching allocator's policy for reserved memory."""

from __future__ import annotations

import itertools

import pytest
import torch

from pytest_vram.backends.segments import (
    CachingAllocatorModel,
    format_cuda_size,
    round_request,
    segment_size_for,
)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize(
    ("request_bytes", "block"),
    [(1, 512), (511, 512), (512, 512), (513, 1024), (1000, 1024), (MiB + 1, MiB + 512)],
)
def test_requests_round_to_512_bytes(request_bytes: int, block: int) -> None:
    assert round_request(request_bytes) == block


@pytest.mark.parametrize(
    ("size", "segment"),
    [
        (512, 2 * MiB),
        (MiB, 2 * MiB),  # up to 1 MiB: the small pool's 2 MiB segments
        (MiB + 512, 20 * MiB),  # 1 MiB to 10 MiB: a 20 MiB segment
        (10 * MiB - 512, 20 * MiB),
        (10 * MiB, 10 * MiB),  # from 10 MiB: the request rounded up to 2 MiB
        (10 * MiB + 512, 12 * MiB),
        (GiB + 1, GiB + 2 * MiB),
    ],
)
def test_segment_sizes(size: int, segment: int) -> None:
    assert segment_size_for(size) == segment


def test_small_allocations_share_one_segment() -> None:
    allocator = CachingAllocatorModel()
    blocks = [allocator.malloc(1000) for _ in range(10)]
    assert allocator.allocated == 10 * 1024
    assert allocator.reserved == 2 * MiB
    assert allocator.segments == 1
    addresses = sorted(block.addr for block in blocks)
    assert [b - a for a, b in itertools.pairwise(addresses)] == [1024] * 9


def test_small_pool_splits_off_every_remainder_of_512_bytes_or_more() -> None:
    allocator = CachingAllocatorModel()
    first = allocator.malloc(MiB)
    second = allocator.malloc(MiB - 512)  # leaves exactly 512 bytes, still split off
    third = allocator.malloc(512)
    assert allocator.segments == 1
    assert second.addr == first.addr + MiB
    assert third.addr == second.addr + MiB - 512
    assert allocator.allocated == allocator.reserved == 2 * MiB


def test_medium_allocations_get_a_20_mib_segment_and_share_it() -> None:
    allocator = CachingAllocatorModel()
    allocator.malloc(3 * MiB)
    assert allocator.reserved == 20 * MiB
    allocator.malloc(5 * MiB)
    allocator.malloc(11 * MiB + 512)  # 12 MiB remain in the segment after the first two
    assert allocator.reserved == 20 * MiB
    assert allocator.segments == 1


def test_large_allocations_round_to_2_mib() -> None:
    allocator = CachingAllocatorModel()
    allocator.malloc(100 * MiB + 1)
    assert allocator.reserved == 102 * MiB
    assert allocator.allocated == 100 * MiB + 512


def test_freed_blocks_are_reused_without_a_new_segment() -> None:
    allocator = CachingAllocatorModel()
    block = allocator.malloc(64 * MiB)
    allocator.free(block)
    assert allocator.allocated == 0
    assert allocator.reserved == 64 * MiB  # cached, not returned
    again = allocator.malloc(64 * MiB)
    assert again.addr == block.addr
    assert allocator.reserved == 64 * MiB
    assert allocator.segments == 1


def test_large_block_is_not_split_for_a_remainder_of_1_mib_or_less() -> None:
    allocator = CachingAllocatorModel()
    allocator.free(allocator.malloc(64 * MiB))
    reused = allocator.malloc(63 * MiB)  # 1 MiB would remain: the whole block is handed out
    assert reused.size == 64 * MiB
    assert allocator.allocated == 64 * MiB
    allocator.free(reused)
    split = allocator.malloc(62 * MiB)  # 2 MiB remain: split
    assert split.size == 62 * MiB
    assert allocator.allocated == 62 * MiB


def test_best_fit_takes_the_smallest_cached_block_that_fits() -> None:
    allocator = CachingAllocatorModel()
    big = allocator.malloc(100 * MiB)
    keep = allocator.malloc(2 * MiB)  # separates two free blocks of different size
    small = allocator.malloc(40 * MiB)
    allocator.free(big)
    allocator.free(small)
    chosen = allocator.malloc(30 * MiB)
    assert chosen.addr == small.addr
    assert allocator.segments == 3
    del keep


def test_freed_neighbours_merge() -> None:
    allocator = CachingAllocatorModel()
    blocks = [allocator.malloc(100 * KiB) for _ in range(3)]
    start = blocks[0].addr
    for block in (blocks[1], blocks[0], blocks[2]):
        allocator.free(block)
    whole = allocator.malloc(MiB)  # the three blocks and the segment's tail merged back
    assert whole.addr == start
    assert allocator.segments == 1


def test_empty_cache_returns_only_entirely_free_segments() -> None:
    allocator = CachingAllocatorModel()
    kept = allocator.malloc(1000)
    freed = allocator.malloc(1000)
    big = allocator.malloc(50 * MiB)
    allocator.free(freed)
    allocator.free(big)
    assert allocator.reserved == 2 * MiB + 50 * MiB
    assert allocator.inactive_split_bytes() == 2 * MiB - 1024
    assert allocator.empty_cache() == 50 * MiB
    assert allocator.reserved == 2 * MiB  # the small segment still holds `kept`
    allocator.free(kept)
    assert allocator.empty_cache() == 2 * MiB
    assert allocator.reserved == 0
    assert allocator.segments == 0


def test_peaks_and_reset() -> None:
    allocator = CachingAllocatorModel()
    block = allocator.malloc(30 * MiB)
    allocator.free(block)
    allocator.empty_cache()
    assert allocator.peak_reserved == 30 * MiB
    assert allocator.peak_allocated == 30 * MiB
    allocator.reset_peak()
    assert allocator.peak_reserved == 0
    assert allocator.peak_allocated == 0


def test_zero_bytes_allocate_nothing() -> None:
    allocator = CachingAllocatorModel()
    assert allocator.malloc(0) is None
    allocator.free(None)
    assert allocator.reserved == 0


def test_out_of_memory_after_returning_the_cache() -> None:
    allocator = CachingAllocatorModel(capacity=100 * MiB)
    cached = allocator.malloc(60 * MiB)
    allocator.free(cached)
    # 60 MiB cached plus 60 MiB new would not fit: the cache goes back first, then it fits.
    allocator.malloc(60 * MiB + 512)
    assert allocator.num_alloc_retries == 1
    assert allocator.num_ooms == 0
    assert allocator.reserved == 62 * MiB
    with pytest.raises(torch.OutOfMemoryError) as caught:
        allocator.malloc(40 * MiB)
    assert allocator.num_ooms == 1
    assert allocator.num_alloc_retries == 2
    message = str(caught.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 40.00 MiB. ")
    assert "GPU 0 has a total capacity of 100.00 MiB of which 38.00 MiB is free." in message
    assert "Of the allocated memory 60.00 MiB is allocated by PyTorch" in message
    # The failed request changed nothing.
    assert allocator.reserved == 62 * MiB
    assert allocator.allocated == 60 * MiB + 512


def test_out_of_memory_is_the_cuda_error_type() -> None:
    assert torch.cuda.OutOfMemoryError is torch.OutOfMemoryError
    allocator = CachingAllocatorModel(capacity=GiB)
    with pytest.raises(torch.cuda.OutOfMemoryError, match=r"Tried to allocate 2\.00 GiB"):
        allocator.malloc(2 * GiB)


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(512, "512 bytes"), (1024, "1024 bytes"), (1536, "1.50 KiB"), (20 * MiB, "20.00 MiB")],
)
def test_sizes_print_as_pytorch_prints_them(nbytes: int, text: str) -> None:
    assert format_cuda_size(nbytes) == text


def test_a_segment_restored_from_a_snapshot_serves_requests_from_its_free_space() -> None:
    allocator = CachingAllocatorModel()
    base = 1 << 40
    # A 20 MiB segment with blocks in use at 0-4 MiB and 8-20 MiB: 4 MiB free between them.
    used = allocator.restore_segment(
        base, 20 * MiB, [(base, 4 * MiB), (base + 8 * MiB, 12 * MiB)], small=False
    )
    assert [(block.addr, block.size) for block in used] == [
        (base, 4 * MiB),
        (base + 8 * MiB, 12 * MiB),
    ]
    assert allocator.allocated == 16 * MiB and allocator.reserved == 20 * MiB
    block = allocator.malloc(3 * MiB + 512)  # leaves 1 MiB - 512 bytes: not split off
    assert block.addr == base + 4 * MiB and block.size == 4 * MiB
    assert allocator.segments == 1 and allocator.allocated == 20 * MiB
    allocator.free(used[0])
    allocator.free(block)
    assert allocator.malloc(8 * MiB).addr == base  # the freed blocks merged
    with pytest.raises(ValueError, match="is not free space of the segment"):
        allocator.restore_segment(base + 20 * MiB, 2 * MiB, [(base, 512)], small=True)


def test_new_segments_go_where_segment_address_says() -> None:
    class Driver(CachingAllocatorModel):
        def segment_address(self, size: int) -> int:
            return 7 << 40

    assert Driver().malloc(MiB).addr == 7 << 40
