"""The storage tracker the cpu and sim backends share: counts, frees, rounding, allocator hooks."""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from pytest_vram.backends.tracker import StorageTracker, round_like_cuda_allocator


def _on_cpu(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "cpu"


@pytest.fixture
def tracker() -> Iterator[StorageTracker]:
    tracker = StorageTracker(counts=_on_cpu)
    with tracker.mode:
        yield tracker


class RecordingAllocator:
    def __init__(self, refuse_above: int | None = None) -> None:
        self.events: list[tuple[str, int]] = []
        self.refuse_above = refuse_above

    def malloc(self, nbytes: int) -> Any:
        if self.refuse_above is not None and nbytes > self.refuse_above:
            raise MemoryError(f"refused {nbytes}")
        self.events.append(("malloc", nbytes))
        return nbytes

    def free(self, handle: Any) -> None:
        self.events.append(("free", handle))


def test_round_like_cuda_allocator() -> None:
    assert [round_like_cuda_allocator(n) for n in (0, 1, 512, 513, 1000)] == [
        0,
        512,
        512,
        1024,
        1024,
    ]


def test_the_existing_interface_still_works() -> None:
    tracker = StorageTracker(counts=_on_cpu)
    with tracker.mode:
        kept = torch.ones(256)
        transient = torch.ones(512)
        del transient
    assert tracker.current == 1024
    assert tracker.peak == 1024 + 2048
    tracker.reset_peak()
    assert tracker.peak == 1024
    del kept
    assert tracker.current == 0


def test_ten_1000_byte_tensors_round_to_10240_bytes() -> None:
    tracker = StorageTracker(counts=_on_cpu, size_of=round_like_cuda_allocator)
    with tracker.mode:
        tensors = [torch.empty(1000, dtype=torch.uint8) for _ in range(10)]
    assert tracker.current == 10_240
    del tensors
    assert tracker.current == 0


def test_views_count_once_and_keep_the_storage(tracker: StorageTracker) -> None:
    base = torch.ones(256)
    views = [base.view(16, 16), base[::2], base.t() if base.dim() == 2 else base[1:]]
    assert tracker.current == 1024
    del base
    assert tracker.current == 1024
    del views
    assert tracker.current == 0


def test_resize_counts_the_growth(tracker: StorageTracker) -> None:
    x = torch.empty(16)
    x.resize_(1024)
    assert tracker.current == 4096
    del x
    assert tracker.current == 0


def test_a_release_on_another_thread_is_counted(tracker: StorageTracker) -> None:
    box = [torch.ones(1024)]
    assert tracker.current == 4096
    thread = threading.Thread(target=box.clear)
    thread.start()
    thread.join()
    assert tracker.current == 0


def test_storages_in_reference_cycles_are_released_by_the_collector(
    tracker: StorageTracker,
) -> None:
    cycle: list[Any] = [torch.ones(1024)]
    cycle.append(cycle)
    del cycle
    gc.collect()
    assert tracker.current == 0


def test_the_allocator_sees_allocations_and_frees_in_order() -> None:
    allocator = RecordingAllocator()
    tracker = StorageTracker(counts=_on_cpu, size_of=round_like_cuda_allocator, allocator=allocator)
    with tracker.mode:
        a = torch.empty(100, dtype=torch.uint8)
        del a
        b = torch.empty(600, dtype=torch.uint8)
        b.resize_(2000)
    del b
    assert tracker.current == 0
    assert allocator.events == [
        ("malloc", 512),
        ("free", 512),
        ("malloc", 1024),
        ("malloc", 2048),  # a resize allocates before it frees
        ("free", 1024),
        ("free", 2048),
    ]


class TagListener:
    def __init__(self) -> None:
        self.events: list[tuple[str, int | None, int]] = []

    def allocated(self, tag: int, size: int, handle: Any) -> None:
        self.events.append(("allocated", tag, size))

    def resized(self, tag: int | None, old: int, new: int, handle: Any) -> None:
        self.events.append(("resized", tag, new))

    def freed(self, tag: int | None, size: int, handle: Any) -> None:
        self.events.append(("freed", tag, size))


def test_a_storage_handed_over_frees_first_and_its_copy_takes_its_tag() -> None:
    allocator = RecordingAllocator()
    tracker = StorageTracker(
        counts=_on_cpu, size_of=round_like_cuda_allocator, allocator=allocator,
        count_unseen_aliases=False,
    )  # fmt: skip
    listener = TagListener()
    tracker.add_listener(listener)
    outside = torch.ones(4)  # made before the tracker watched
    with tracker.mode:
        source = torch.empty(1000, dtype=torch.uint8)
        with tracker.handing_over(source) as counted:
            assert counted
            copy = source.clone()
        other = torch.empty(10, dtype=torch.uint8)
        source.view(10, 100).add_(1)  # an alias of what was handed over is not counted again
        with tracker.handing_over(outside) as counted:  # never counted: nothing to hand over
            assert not counted
    assert tracker.current == 1024 + 512
    assert tracker.peak == 1024 + 512  # the bytes never counted twice
    (first, _, _), (second, tag, _), (third, copied, _), (_, new, _) = listener.events[:4]
    assert (first, second, third) == ("allocated", "freed", "allocated")
    assert copied == tag and new != tag
    assert allocator.events[:3] == [("malloc", 1024), ("free", 1024), ("malloc", 1024)]
    del copy, other
    tracker.remove_listener(listener)


def test_a_refused_allocation_is_not_counted() -> None:
    allocator = RecordingAllocator(refuse_above=4096)
    tracker = StorageTracker(counts=_on_cpu, allocator=allocator)
    with tracker.mode:
        small = torch.empty(1024, dtype=torch.uint8)
        with pytest.raises(MemoryError, match="refused 8192"):
            torch.empty(8192, dtype=torch.uint8)
    assert tracker.current == 1024
    assert tracker.peak == 1024
    del small


def test_on_allocate_may_read_the_counts() -> None:
    seen: list[int] = []
    tracker: StorageTracker

    def on_allocate(nbytes: int) -> None:
        seen.append(tracker.current + nbytes)

    tracker = StorageTracker(counts=_on_cpu, on_allocate=on_allocate)
    with tracker.mode:
        a = torch.empty(100, dtype=torch.uint8)
        b = torch.empty(50, dtype=torch.uint8)
    assert seen == [100, 150]
    del a, b


def test_two_trackers_count_the_same_storage_independently() -> None:
    first = StorageTracker(counts=_on_cpu)
    second = StorageTracker(counts=_on_cpu)
    with first.mode:
        x = torch.ones(256)
        with second.mode:
            x.mul_(2)  # the second tracker first sees x here
    assert first.current == second.current == 1024
    del x
    assert first.current == second.current == 0


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x.add_(1),
        lambda x: x.view(32, 32),
        lambda x: torch.mul(x, 2, out=x),
        lambda x: x.detach(),
    ],
    ids=["in-place", "view", "out", "detach"],
)
def test_without_unseen_aliases_touching_an_older_tensor_allocates_nothing(
    op: Callable[[torch.Tensor], object],
) -> None:
    before = torch.ones(1024)
    tracker = StorageTracker(counts=_on_cpu, count_unseen_aliases=False)
    with tracker.mode:
        result = op(before)
        fresh = torch.tensor([1.0, 2.0])  # lift_fresh aliases by schema, yet is new
        copy = before * 2
    assert tracker.current == 8 + 4096
    del result, fresh, copy


def test_without_unseen_aliases_resizes_of_counted_storages_still_count() -> None:
    tracker = StorageTracker(counts=_on_cpu, count_unseen_aliases=False)
    with tracker.mode:
        x = torch.empty(16)
        x.resize_(1024)
        x.resize_(0)  # storages keep their size when a tensor shrinks
        torch.mul(torch.ones(2048), 2, out=x)  # out= grows its output
    assert tracker.current == 8192
    del x


def test_by_default_an_unseen_storage_counts_when_it_first_shows_up() -> None:
    before = torch.ones(1024)
    tracker = StorageTracker(counts=_on_cpu)
    with tracker.mode:
        view = before.view(32, 32)
    assert tracker.current == 4096
    del view


def test_outputs_that_are_not_tensors_are_ignored() -> None:
    tracker = StorageTracker(counts=_on_cpu)
    x, y = torch.ones(4), torch.ones(8)  # made outside the tracker: unseen so far
    tracker.observe_output(torch.ops.aten.add.Tensor, None)
    tracker.observe_output(torch.ops.aten.add.Tensor, 3)
    tracker.observe_output(torch.ops.aten.add.Tensor, [x, (x, {"y": y})])
    assert tracker.current == 16 + 32
    del x, y
    assert tracker.current == 0


def test_the_tracker_needs_no_simulated_device() -> None:
    # The cpu backend and attribution count with it: importing it leaves the sim wing unloaded.
    code = (
        "import sys, pytest_vram.backends.tracker; "
        "print(sorted(m for m in sys.modules if m.startswith('pytest_vram.backends.sim')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_gradient_from_two_places_is_summed_in_place() -> None:
    # The autograd engine sums w's two gradients in place on CUDA; the tracker's record of the
    # first would make it sum out of place, a third gradient-sized buffer.
    w = torch.ones(256, requires_grad=True)
    tracker = StorageTracker(counts=_on_cpu, count_unseen_aliases=False)
    with tracker.mode:
        ((w * 2).sum() + (w * 3).sum()).backward()
        assert tracker.peak < 3 * 1024
    assert w.grad is not None
    assert torch.equal(w.grad, torch.full((256,), 5.0))
