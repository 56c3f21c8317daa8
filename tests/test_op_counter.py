"""The op counter: what ops return, counted inside PyTorch's CPU allocator, as the sim backend
counts a test that computes. Its figures must be the dispatch tracker's, op for op."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from pytest_vram.backends.cpu import allocator as cpu_allocator
from pytest_vram.backends.segments import CachingAllocatorModel
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.tracker import StorageTracker, round_like_cuda_allocator

MiB = 1 << 20

try:
    cpu_allocator.load()
except cpu_allocator.CounterUnavailable as exc:  # pragma: no cover - no compiler here
    pytest.skip(f"the counting allocator is unavailable: {exc}", allow_module_level=True)


@pytest.fixture
def ops() -> Iterator[cpu_allocator.OpCounter]:
    counter = cpu_allocator.OpCounter()
    counter.watch()
    try:
        yield counter
    finally:
        counter.unwatch()


def test_an_op_output_counts_rounded_as_the_cuda_allocator_rounds(
    ops: cpu_allocator.OpCounter,
) -> None:
    before = ops.current
    x = torch.ones(100)  # 400 bytes: one 512-byte block
    assert ops.current - before == 512
    y = torch.ones(1000)  # 4000 bytes: 4096
    assert ops.current - before == 512 + 4096
    assert ops.counts(x.untyped_storage().data_ptr())
    del x, y
    assert ops.current == before


def test_an_op_output_counts_the_block_handed_out_as_cuda_does(
    ops: cpu_allocator.OpCounter,
) -> None:
    # 19.5 MiB takes a 20 MiB segment; the half MiB left is too small to split off, so the
    # block handed out, and counted allocated on CUDA, is the whole segment.
    x = torch.empty(39 * MiB // 2, dtype=torch.uint8)
    assert (ops.current, ops.peak) == (20 * MiB, 20 * MiB)
    assert ops.segments().allocated == 20 * MiB
    del x
    assert ops.current == 0


@pytest.mark.parametrize(
    "op",
    [lambda x: tuple(x.median(dim=0)), lambda x: (torch.unique(x),)],
    ids=["median", "unique"],
)
def test_what_a_kernel_allocates_and_frees_for_itself_never_counts(
    ops: cpu_allocator.OpCounter, op: Callable[[torch.Tensor], tuple[torch.Tensor, ...]]
) -> None:
    x = torch.randn(256, 256)
    everything = cpu_allocator.AllocatorCounter()
    everything.watch()
    try:
        ops.reset_peak()
        everything.reset_peak()
        start = ops.current
        outputs = op(x)
    finally:
        everything.unwatch()
    returned = sum(round_like_cuda_allocator(t.untyped_storage().nbytes()) for t in outputs)
    # The kernel's own buffers reach the allocator, as they reach the CUDA allocator...
    assert everything.peak > 4 * returned
    # ...but a dispatch mode sees the outputs only, and so does the op counter.
    assert ops.current - start == returned
    assert ops.peak - start == returned


def test_a_forgotten_block_counts_no_more_and_its_free_takes_nothing_off(
    ops: cpu_allocator.OpCounter,
) -> None:
    kept = torch.ones(1000)  # 4096 bytes
    before = ops.current
    moved = torch.ones(1000)
    data = moved.untyped_storage().data_ptr()
    assert ops.forget(data)
    assert ops.current == before and not ops.counts(data)
    assert not ops.forget(data)  # once only
    del moved
    assert ops.current == before
    assert ops.counts(kept.untyped_storage().data_ptr())
    assert not ops.forget(0)


def test_what_python_makes_outside_any_op_is_not_counted(ops: cpu_allocator.OpCounter) -> None:
    x = torch.ones(1024)
    ops.reset_peak()
    start = ops.current
    y = x * 2  # Python wraps the 2 in a tensor before the op: a dispatch mode never sees it
    assert ops.current - start == 4096
    assert ops.peak - start == 4096
    del y


def test_host_memory_and_other_threads_are_not_counted(ops: cpu_allocator.OpCounter) -> None:
    start = ops.current
    with ops.uncounted():
        host = torch.zeros(1024)
    made: list[torch.Tensor] = []
    thread = threading.Thread(target=lambda: made.append(torch.zeros(1024)))
    thread.start()
    thread.join()
    assert ops.current == start
    assert not ops.counts(host.untyped_storage().data_ptr())


def test_a_storage_resized_outside_any_op_counts_inside_as_one_op(
    ops: cpu_allocator.OpCounter,
) -> None:
    storage = torch.ones(1024).untyped_storage()
    start = ops.current
    storage.resize_(8192)
    assert ops.current == start - 4096  # the old block went; the new one was not seen
    with ops.as_one_op():
        storage.resize_(16384)
    assert ops.current == start - 4096 + 16384


def figures(counter: cpu_allocator.OpCounter) -> tuple[object, int]:
    return counter.segments(), counter.inactive_split_bytes()


def model_figures(model: CachingAllocatorModel) -> tuple[object, int]:
    return model.figures(), model.inactive_split_bytes()


def test_the_segment_model_is_segments_py_request_for_request() -> None:
    rng = random.Random(0)
    sizes = [100, 512, 4096, 70_000, 900_000, 1_500_000, 6_000_000, 12_000_000, 30_000_000]
    model, blocks, live = CachingAllocatorModel(), {}, {}
    counter = cpu_allocator.OpCounter()
    counter.watch()
    try:
        for step in range(600):
            if live and rng.random() < 0.45:
                key = rng.choice(list(live))
                del live[key]
                model.free(blocks.pop(key))
            elif step % 97 == 96:
                assert counter.empty_cache() == model.empty_cache()
            else:
                nbytes = rng.choice(sizes) + rng.randrange(512)
                live[step] = torch.empty(nbytes, dtype=torch.uint8)
                blocks[step] = model.malloc(nbytes)
            assert figures(counter) == model_figures(model), step
            if step % 50 == 49:
                counter.reset_segment_peaks()
                model.reset_peak()
        assert model.num_device_free > 0 and model.inactive_split_bytes() > 0
    finally:
        counter.unwatch()


def test_a_limit_refuses_the_allocation_with_the_message_and_the_size(
    ops: cpu_allocator.OpCounter,
) -> None:
    ops.limit(ops.current + 1 * MiB, "head: ", " would be live")
    try:
        kept = torch.empty(512 * 1024, dtype=torch.uint8)
        with pytest.raises(torch.OutOfMemoryError, match=r"^head: 2\.50 MiB would be live"):
            torch.empty(2 * MiB, dtype=torch.uint8)
        del kept
    finally:
        ops.limit(None)
    torch.empty(2 * MiB, dtype=torch.uint8)  # no limit any more


def _mlp_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.LayerNorm(256), nn.Linear(256, 10))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        x = torch.randn(32, 64)
        loss = nn.functional.cross_entropy(model(x), torch.randint(0, 10, (32,)))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    del loss


def _conv_step() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2)
    )
    out = model(torch.randn(4, 3, 32, 32))
    out.sum().backward()
    with torch.no_grad():
        model.eval()
        model(torch.randn(2, 3, 32, 32)).softmax(dim=1)


def _attention() -> None:
    q, k, v = (torch.randn(2, 4, 128, 32, requires_grad=True) for _ in range(3))
    out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    out.sum().backward()


def _in_place_views_and_out() -> None:
    x = torch.zeros(64, 64)
    x[:8].add_(1).mul_(2)
    y = x.t().contiguous().view(-1)
    out = torch.empty(0)
    torch.mul(x, 3, out=out)  # resizes out
    torch.cat([x, y.view(64, 64)], dim=0, out=torch.empty(10))
    del y, out


@pytest.mark.parametrize(
    "code",
    [_mlp_step, _conv_step, _attention, _in_place_views_and_out],
    ids=["mlp-adamw", "conv-batchnorm", "sdpa", "in-place-views-out"],
)
def test_the_figures_are_the_dispatch_trackers(code: Callable[[], None]) -> None:
    def is_cpu(tensor: torch.Tensor) -> bool:
        return tensor.is_cpu

    dispatch_model = CachingAllocatorModel()
    tracker = StorageTracker(
        counts=is_cpu,
        size_of=round_like_cuda_allocator,
        allocator=dispatch_model,
        count_unseen_aliases=False,
    )
    with tracker.mode:
        code()
    tracker.flush()

    counter = cpu_allocator.OpCounter()
    counter.watch()
    try:
        code()
    finally:
        counter.unwatch()

    assert (counter.current, counter.peak) == (tracker.current, tracker.peak)
    assert counter.peak > 0
    assert figures(counter) == model_figures(dispatch_model)


def test_a_computing_sim_test_pushes_no_dispatch_mode() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    backend = SimBackend()
    backend.use_values(True)
    backend.begin_test()
    try:
        assert _get_current_dispatch_mode() is None
        x = torch.ones(1024, device="cuda")
        assert backend.allocated() == 4096
        assert backend.storage_bytes(x) == 4096
        assert backend.reserved() == 2 * MiB
        assert torch.cuda.memory_allocated() == 4096
    finally:
        backend.end_test()


def _computing_device(*, through_python: bool) -> SimBackend:
    """A simulated device that models cuBLAS workspaces, for tests that compute: counted by
    the op counter, or (``through_python``) by the tracker's dispatch mode, which a device with
    a capacity gets (one far above what the code needs)."""
    backend = SimBackend(capacity="1TiB" if through_python else None, workspaces=True)
    backend.use_values(True)
    return backend


def _test_figures(backend: SimBackend) -> tuple[int | None, ...]:
    """What a test's record keeps: allocated, its peak, and the test's own reserved and peak."""
    return (
        backend.allocated(),
        backend.peak_allocated(),
        backend.own_reserved(),
        backend.own_peak_reserved(),
    )


def _sim_figures(code: Callable[[], None], *, through_python: bool) -> tuple[int | None, ...]:
    """Figures of ``code`` run as a computing test (see :func:`_computing_device`)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    backend = _computing_device(through_python=through_python)
    backend.begin_test()
    try:
        assert (_get_current_dispatch_mode() is None) is not through_python
        code()
        figures = _test_figures(backend)
        backend.release_workspaces()
        after_release = backend.allocated()
    finally:
        backend.end_test()
        backend.release_cache()
    return (*figures, after_release)


@pytest.mark.parametrize(
    "code",
    [_mlp_step, _conv_step, _attention, _in_place_views_and_out],
    ids=["mlp-adamw", "conv-batchnorm", "sdpa", "in-place-views-out"],
)
def test_the_op_counter_allocates_cublas_workspaces_as_the_tracker_does(
    code: Callable[[], None],
) -> None:
    native = _sim_figures(code, through_python=False)
    assert native == _sim_figures(code, through_python=True)
    workspace = SimBackend(workspaces=True).workspaces.size
    if code is _mlp_step:
        # A matrix multiply in forward and one in backward: two workspaces at the peak.
        assert native[1] >= 2 * workspace
    elif code in (_attention, _in_place_views_and_out):
        assert native[1] < workspace  # fused attention and copies: no cuBLAS, no workspace
    assert native[4] < workspace  # released with the workspaces


def _makes_a_fixture_then_runs(backend: SimBackend) -> None:
    """A test whose broader-scoped fixture is made in its set-up: making it leaves cached
    blocks behind, which a later test would not see; then the test's own work."""
    scratch = torch.randn(3 * MiB)  # 12 MiB, a segment of its own
    kept = scratch[: MiB // 4].clone()  # what the fixture holds: 1 MiB, a small block
    del scratch
    backend.restart_own()  # as the plugin does once the fixture is made
    backend.reset_peak()
    model = nn.Linear(256, 256)
    model(torch.randn(64, 256)).sum().backward()
    del kept


def test_a_fixture_made_in_set_up_is_laid_out_anew_as_the_tracker_does() -> None:
    figures = {}
    for python in (False, True):
        backend = _computing_device(through_python=python)
        backend.begin_test()
        try:
            _makes_a_fixture_then_runs(backend)
            figures[python] = _test_figures(backend)
        finally:
            backend.end_test()
            backend.release_cache()
    assert figures[False] == figures[True]
    # The 12 MiB temporary took a segment of its own while the fixture was made; laid out
    # anew, the 1 MiB the fixture keeps needs a 2 MiB one, beside the step's own blocks and
    # its two workspaces.
    workspaces = 2 * SimBackend(workspaces=True).workspaces.size
    assert workspaces < figures[False][3] < workspaces + 12 * MiB


def test_a_test_counts_here_beside_its_fixtures_and_what_earlier_tests_left() -> None:
    # An earlier test made what a broader-scoped fixture holds, and left memory behind (in a
    # module's list, say). The next test that uses the fixture still counts here, and its own
    # figures are the tracker's: the fixture laid out anew on its segments, what was left
    # behind on none of them.
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    figures = {}
    for python in (False, True):
        backend = _computing_device(through_python=python)
        backend.begin_test()
        try:
            fixture = torch.randn(MiB // 4)  # 1 MiB
            left_behind = [torch.randn(3 * MiB), torch.randn(1000)]
        finally:
            backend.end_test()
            backend.release_workspaces()
            backend.release_cache()
        backend.own_memory([fixture])
        backend.begin_test()
        try:
            assert (_get_current_dispatch_mode() is None) is not python
            backend.reset_peak()
            _mlp_step()
            figures[python] = (*_test_figures(backend), backend.reserved())
        finally:
            backend.end_test()
            backend.release_workspaces()
            backend.release_cache()
        del fixture, left_behind
    # The device's reserved memory differs: what was left behind shares no segment with the
    # fixture here, as it may there.
    assert figures[False][:4] == figures[True][:4]
    own_reserved, own_peak_reserved, reserved = figures[False][2:]
    # The 12 MiB left behind is the device's, in a segment of its own, and not the test's.
    assert reserved >= 12 * MiB + own_reserved
    assert own_peak_reserved < 12 * MiB + 2 * SimBackend(workspaces=True).workspaces.size
