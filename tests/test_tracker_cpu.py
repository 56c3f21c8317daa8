"""The cpu backend counts the bytes of live tensor storages exactly, with either counter."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

from pytest_vram.backends.cpu import build as cpu_build
from pytest_vram.backends.cpu.backend import CpuBackend
from pytest_vram.measure.measurement import TestMeasurement

COUNTERS = ["allocator", "dispatch"]


def open_backend(counter: str) -> CpuBackend:
    """A cpu backend with ``counter``; skip the allocator counter only where no compiler is."""
    if counter == "allocator" and cpu_build.find_compiler() is None:
        pytest.skip("no C++ compiler here to build the allocator counter")
    backend = CpuBackend(counter)
    assert backend.counter.name == counter
    return backend


@pytest.fixture(params=COUNTERS)
def counter(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def cpu(counter: str) -> Iterator[CpuBackend]:
    backend = open_backend(counter)
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.close()


def test_backend_identity() -> None:
    backend = CpuBackend()
    assert backend.name == "cpu"
    assert backend.device == torch.device("cpu")
    assert backend.device_class == "cpu"
    total = backend.total_memory()
    assert total is None or total > 0


@pytest.mark.parametrize(
    ("make", "nbytes"),
    [
        (lambda: torch.ones(128), 512),
        (lambda: torch.zeros(10, 10, dtype=torch.float64), 800),
        (lambda: torch.empty(1000, dtype=torch.int8), 1000),
        (lambda: torch.ones(7, dtype=torch.bool), 7),
        (lambda: torch.arange(16, dtype=torch.int64), 128),
        (lambda: torch.randn(3, 5, dtype=torch.bfloat16), 30),
        (lambda: torch.empty(0), 0),
    ],
)
def test_counts_exact_storage_bytes(
    cpu: CpuBackend, make: Callable[[], torch.Tensor], nbytes: int
) -> None:
    tensor = make()
    assert cpu.allocated() == nbytes
    assert cpu.peak_allocated() == nbytes
    del tensor


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x.view(16, 16),
        lambda x: x[::2],
        lambda x: x[10:20],
        lambda x: x.view(16, 16).t(),
        lambda x: x.reshape(4, 64),
        lambda x: x.unsqueeze(0).expand(3, 256),
        lambda x: x.narrow(0, 5, 7),
        lambda x: x.detach(),
        lambda x: x.view(torch.int32),
    ],
)
def test_views_share_the_storage(cpu: CpuBackend, view: Callable[[torch.Tensor], object]) -> None:
    base = torch.ones(256)
    views = [view(base), view(base)]
    assert cpu.allocated() == 1024
    del base
    assert cpu.allocated() == 1024  # the views keep the storage alive
    del views
    assert cpu.allocated() == 0


def test_copies_are_counted(cpu: CpuBackend) -> None:
    base = torch.ones(256)
    copy = base.clone()
    contiguous = base.view(16, 16).t().contiguous()  # a transposed view must be copied
    assert cpu.allocated() == 3 * 1024
    del base, copy, contiguous


def test_del_frees(cpu: CpuBackend) -> None:
    a = torch.ones(128)
    b = torch.ones(256)
    assert cpu.allocated() == 512 + 1024
    del a
    assert cpu.allocated() == 1024
    del b
    assert cpu.allocated() == 0
    assert cpu.peak_allocated() == 1536


def test_temporaries_are_freed(cpu: CpuBackend) -> None:
    x = torch.ones(256)
    y = (x * x + x).sum()
    assert cpu.allocated() == 1024 + 4
    # x, x * x and x * x + x at once; x * x is gone before the sum is taken.
    assert cpu.peak_allocated() == 3 * 1024
    del x, y


def test_resize_is_seen(cpu: CpuBackend) -> None:
    x = torch.empty(0)
    assert cpu.allocated() == 0
    x.resize_(256)
    assert cpu.allocated() == 1024
    x.resize_(1024)
    assert cpu.allocated() == 4096
    del x
    assert cpu.allocated() == 0


@pytest.mark.parametrize(
    "op",
    [
        lambda x, y: x.add_(y),
        lambda x, y: x.mul_(y),
        lambda x, y: x.zero_(),
        lambda x, y: x.copy_(y),
        lambda x, y: x.clamp_(0, 1),
        lambda x, y: x.relu_(),
        lambda x, y: x.fill_(3),
        lambda x, y: x.view(16, 16).t_(),
        lambda x, y: x[3:9].normal_(),
    ],
)
def test_in_place_ops_allocate_nothing(cpu: CpuBackend, op: Callable[..., object]) -> None:
    x = torch.ones(256)
    y = torch.full((256,), 2.0)
    cpu.reset_peak()
    op(x, y)
    assert cpu.allocated() == 2048
    assert cpu.peak_allocated() == 2048
    del x, y


def test_out_tensor_that_must_grow(cpu: CpuBackend) -> None:
    a = torch.ones(256)
    b = torch.ones(256)
    out = torch.empty(0)
    torch.add(a, b, out=out)
    assert cpu.allocated() == 3 * 1024
    del a, b, out
    assert cpu.allocated() == 0


def test_out_tensor_of_the_right_size(cpu: CpuBackend) -> None:
    a = torch.ones(256)
    b = torch.ones(256)
    out = torch.empty(256)
    cpu.reset_peak()
    torch.mul(a, b, out=out)
    torch.matmul(a.view(16, 16), b.view(16, 16), out=out.view(16, 16))
    assert cpu.allocated() == 3 * 1024
    assert cpu.peak_allocated() == 3 * 1024
    del a, b, out


def test_reset_peak_starts_from_current(cpu: CpuBackend) -> None:
    kept = torch.ones(256)
    spike = torch.ones(1024)
    del spike
    assert cpu.peak_allocated() == 1024 + 4096
    cpu.reset_peak()
    assert cpu.peak_allocated() == 1024
    del kept


def test_other_devices_are_not_counted(cpu: CpuBackend) -> None:
    meta = torch.empty(1_000_000, device="meta")
    assert cpu.allocated() == 0
    del meta


def test_tensors_created_while_no_test_runs_are_not_counted(counter: str) -> None:
    backend = open_backend(counter)
    before = torch.ones(1024)
    backend.begin_test()
    try:
        assert backend.allocated() == 0
        kept = torch.ones(128)
        assert backend.allocated() == 512
        del before  # not counted, so freeing it changes nothing
        assert backend.allocated() == 512
    finally:
        backend.end_test()
        backend.pause()  # what the plugin does before anything but a measured cpu test runs
    between = torch.ones(4096)
    assert backend.allocated() == 512
    backend.begin_test()
    try:
        assert backend.allocated() == 512
        del between
        assert backend.allocated() == 512
        del kept
        assert backend.allocated() == 0  # frees are seen between tests too
    finally:
        backend.close()


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x.add_(x),
        lambda x: x.view(32, 32),
        lambda x: torch.mul(x, x, out=x),
    ],
    ids=["in-place", "view", "out"],
)
def test_touching_a_tensor_made_before_the_test_allocates_nothing(
    counter: str, op: Callable[[torch.Tensor], object]
) -> None:
    backend = open_backend(counter)
    before = torch.ones(1024)
    backend.begin_test()
    try:
        op(before)
        assert backend.allocated() == 0
        assert backend.peak_allocated() == 0
    finally:
        backend.close()


def test_counting_goes_on_after_end_test_until_pause(counter: str) -> None:
    backend = open_backend(counter)
    backend.begin_test()
    backend.end_test()
    try:
        kept = torch.ones(256)  # between two measured tests: still counted
        backend.begin_test()  # the next measured test goes on counting
        assert backend.allocated() == 1024
        backend.end_test()
    finally:
        backend.pause()
    unseen = torch.ones(512)  # paused: not counted
    assert backend.allocated() == 1024
    backend.pause()  # pausing twice is harmless
    del kept, unseen
    assert backend.allocated() == 0


def test_the_dispatch_counter_pushes_one_mode_until_pause() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    backend = CpuBackend("dispatch")
    mode = backend.counter.tracker.mode
    backend.begin_test()
    backend.end_test()
    try:
        assert mode in _get_current_dispatch_mode_stack()
        backend.begin_test()  # the next measured test does not push a second mode
        assert _get_current_dispatch_mode_stack().count(mode) == 1
    finally:
        backend.pause()
    assert mode not in _get_current_dispatch_mode_stack()


def _workload() -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 8))
    inputs = torch.randn(16, 32)
    loss = model(inputs).pow(2).mean()
    loss.backward()
    return model[0].weight.grad.sum()


def _measure(backend: CpuBackend) -> tuple[int, int, int]:
    m = TestMeasurement(backend, "t.py::test_workload")
    m.begin()
    result = _workload()
    m.finish_call()
    del result
    m.end()
    return m.record.start_allocated, m.record.peak_allocated, m.record.end_allocated


def test_same_bytes_on_repeated_runs(counter: str) -> None:
    backend = open_backend(counter)
    first = _measure(backend)
    second = _measure(backend)
    backend.close()
    other = open_backend(counter)
    third = _measure(other)
    other.close()
    assert first == second == third
    start, peak, end = first
    assert start == 0
    assert end == 0
    # Weights and biases alone are (32 * 64 + 64 + 64 * 8 + 8) floats.
    assert peak > (32 * 64 + 64 + 64 * 8 + 8) * 4
