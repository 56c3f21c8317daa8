"""The counting CPU allocator: what it sees that the dispatch counter does not, threads,
several counters at once, and how it is built, cached and replaced when it cannot be."""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pytest_vram.backends import BackendUnavailable
from pytest_vram.backends.cpu import allocator as cpu_allocator
from pytest_vram.backends.cpu import build as cpu_build
from pytest_vram.backends.cpu.allocator import CounterUnavailable
from pytest_vram.backends.cpu.backend import CpuBackend

needs_compiler = pytest.mark.skipif(
    cpu_build.find_compiler() is None, reason="no C++ compiler to build the counter"
)


@pytest.fixture
def cpu() -> Iterator[CpuBackend]:
    if cpu_build.find_compiler() is None:
        pytest.skip("no C++ compiler to build the counter")
    backend = CpuBackend("allocator")
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.close()


def test_what_a_kernel_allocates_for_itself_counts_in_the_peak(cpu: CpuBackend) -> None:
    x = torch.randn(1024)
    cpu.reset_peak()
    median = x.median()  # the kernel sorts a copy of its input
    assert cpu.allocated() == 4096 + 4
    assert cpu.peak_allocated() >= 4096 + 4 + 4096
    del x, median

    dispatch = CpuBackend("dispatch")
    dispatch.begin_test()
    try:
        x = torch.randn(1024)
        dispatch.reset_peak()
        median = x.median()
        assert dispatch.peak_allocated() == 4096 + 4  # the dispatch counter sees outputs only
        del x, median
    finally:
        dispatch.close()


def test_a_python_number_in_an_op_is_a_short_lived_cpu_tensor(cpu: CpuBackend) -> None:
    x = torch.ones(256)
    cpu.reset_peak()
    x.add_(1)
    assert cpu.allocated() == 1024
    assert 1024 < cpu.peak_allocated() <= 1024 + 64
    del x


def test_kernels_that_allocate_through_the_raw_interface_are_counted(cpu: CpuBackend) -> None:
    # oneDNN (gelu, linear) takes its buffers through Allocator::raw_allocate and frees them
    # through raw_deleter(), on blocks counted and not.
    before = torch.randn(64, 64)
    out = torch.nn.functional.gelu(before)
    layer = torch.nn.Linear(64, 64)
    y = layer(out).relu()
    assert cpu.allocated() == 64 * 64 * 4 * 2 + (64 * 64 + 64) * 4 + 64 * 64 * 4
    del before, out, layer, y
    assert cpu.allocated() == 0


def test_lazy_clones_share_the_block_until_written(cpu: CpuBackend) -> None:
    x = torch.ones(256)
    clone = x._lazy_clone()
    assert cpu.allocated() == 1024  # copy-on-write: one block for both
    clone.add_(clone)  # the write copies
    assert cpu.allocated() == 2048
    assert x.sum().item() == 256 and clone.sum().item() == 512
    del x, clone
    assert cpu.allocated() == 0


def test_other_threads_allocations_are_not_counted_but_their_frees_are(cpu: CpuBackend) -> None:
    uncounted: list[torch.Tensor] = []
    counted = [torch.ones(256)]
    making = threading.Thread(target=lambda: uncounted.append(torch.ones(4096)))
    making.start()
    making.join()
    assert cpu.allocated() == 1024
    freeing = threading.Thread(target=counted.clear)  # the last reference dies on that thread
    freeing.start()
    freeing.join()
    assert cpu.allocated() == 0
    assert cpu.peak_allocated() == 1024
    uncounted.clear()
    assert cpu.allocated() == 0


@needs_compiler
def test_two_backends_count_independently() -> None:
    outer, inner = CpuBackend("allocator"), CpuBackend("allocator")
    outer.begin_test()
    try:
        a = torch.ones(256)
        inner.begin_test()
        b = torch.ones(512)
        assert (outer.allocated(), inner.allocated()) == (3072, 2048)
        outer.pause()
        c = torch.ones(1024)
        assert (outer.allocated(), inner.allocated()) == (3072, 6144)
        del a, b, c
        assert (outer.allocated(), inner.allocated()) == (0, 0)
        assert (outer.peak_allocated(), inner.peak_allocated()) == (3072, 6144)
    finally:
        outer.close()
        inner.close()


@needs_compiler
def test_a_fifth_counter_at_once_is_refused_with_a_clear_error() -> None:
    backends = [CpuBackend("allocator") for _ in range(5)]
    try:
        for backend in backends[:4]:
            backend.begin_test()
        with pytest.raises(BackendUnavailable, match="four counters already watch"):
            backends[4].begin_test()
        backends[0].pause()
        backends[4].begin_test()  # a slot is free again
    finally:
        for backend in backends:
            backend.close()


# -- building, caching, falling back -------------------------------------------------------


@pytest.fixture
def fresh_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """As in a new process on a new machine: nothing loaded yet, an empty cache directory."""
    monkeypatch.setattr(cpu_allocator, "_library", None)
    monkeypatch.setattr(cpu_build, "_cache_note", None)
    monkeypatch.setattr(cpu_allocator, "_loaded_note", None)
    monkeypatch.setenv("PYTEST_VRAM_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@needs_compiler
def test_the_library_is_built_once_into_the_cache(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = cpu_build.library_path()
    assert path.parent == fresh_cache
    stamp = cpu_build.stamp_path(path)
    lock = fresh_cache / "cpu_allocator.lock"
    assert sorted(fresh_cache.iterdir()) == sorted([path, stamp, lock])  # no partial files
    # Loaded apart (never installed: the process has its counter already), it is whole.
    library = ctypes.CDLL(str(path))
    assert library.pytest_vram_counter_layout() == 0

    def must_not_build(*args: object) -> None:
        raise AssertionError("built again although the cache has the library")

    monkeypatch.setattr(cpu_build, "_build", must_not_build)
    assert cpu_build.library_path() == path


# Builds the library twice; the test above builds it by default.
@pytest.mark.slow
@needs_compiler
def test_a_cached_library_that_no_longer_loads_is_built_anew(fresh_cache: Path) -> None:
    path = cpu_build.library_path()
    path.write_bytes(b"not a shared library")
    library, opened = cpu_build.open_library()
    assert opened == path
    assert library.pytest_vram_counter_layout() == 0  # loaded apart, never installed
    assert path.read_bytes() != b"not a shared library"


@needs_compiler
def test_a_changed_source_gets_its_own_library() -> None:
    compiler = cpu_build.find_compiler()
    assert compiler is not None
    source = cpu_build.SOURCE.read_bytes()
    first = cpu_build._library_name(source, compiler)
    assert cpu_build._library_name(source + b"\n// changed\n", compiler) != first
    assert cpu_build._library_name(source, compiler) == first


@needs_compiler
def test_a_build_error_names_the_compiler_and_the_error(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    broken = tmp_path / "cpu_allocator.cpp"
    broken.write_text("this is not C++\n")
    monkeypatch.setattr(cpu_build, "SOURCE", broken)
    with pytest.raises(CounterUnavailable, match=r"could not build cpu_allocator\.cpp: .*error"):
        cpu_build.library_path()
    assert not list(fresh_cache.glob("*.so"))  # nothing half-built is cached


def test_without_a_compiler_auto_counts_from_python_and_says_why(
    fresh_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(cpu_build, "find_compiler", lambda: None)
    backend = CpuBackend("auto")
    assert backend.counter.name == "dispatch"
    assert backend.environment()["cpu_counter"] == "dispatch"
    (note,) = backend.notes()
    assert "counts from Python" in note
    assert "no C++ compiler found" in note
    with pytest.raises(BackendUnavailable, match=r"no C\+\+ compiler found"):
        CpuBackend("allocator")


def test_the_counter_reads_its_figures_in_place(cpu: CpuBackend) -> None:
    counter = cpu.counter
    assert isinstance(counter, cpu_allocator.AllocatorCounter)
    x = torch.ones(100)
    assert counter.current == 400
    # The figures are read from the counter's memory, not through a call.
    assert isinstance(counter._current, ctypes.c_int64)
    del x
    assert counter.current == 0


@pytest.mark.slow
@needs_compiler
def test_counted_tensors_still_alive_at_exit_are_freed_cleanly() -> None:
    script = (
        "import torch\n"
        "from pytest_vram.backends.cpu.backend import CpuBackend\n"
        "backend = CpuBackend('allocator')\n"
        "backend.begin_test()\n"
        "KEPT = [torch.ones(1000) for _ in range(100)]\n"
        "torch.nn.functional.gelu(torch.randn(64, 64))\n"
        "print(backend.allocated())\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(100 * 4000)
