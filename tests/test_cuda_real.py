"""The cuda backend on a real GPU: skipped where there is none (scripts/gpu-check.sh runs them).

Each test asserts figures the CUDA caching allocator gives exactly: a 4 MiB tensor is one
4 MiB block, and peaks reset per test. The device figure is above the device's floor (its
context and cuBLAS handle made before any test): a small test's is small, whichever ran first.
"""

from __future__ import annotations

import pickle

import pytest
import torch

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytestmark = needs_gpu

MiB = 1024 * 1024


def test_real_cuda_backend_reads_the_allocator() -> None:
    from pytest_vram.backends.cuda.backend import CudaBackend

    backend = CudaBackend()
    try:
        backend.release_cache()
        backend.begin_test()
        backend.reset_peak()
        start = backend.allocated()
        x = torch.empty(MiB, device=backend.device)  # 4 MiB of float32
        assert backend.allocated() - start == 4 * MiB
        del x
        assert backend.allocated() == start
        assert backend.peak_allocated() - start == 4 * MiB
        assert backend.peak_reserved() >= 4 * MiB
        backend.end_test()
        if backend.nvml_note is None:
            # The cached segment holding the tensor, above the floor; the context and the
            # cuBLAS handle are the floor's.
            assert backend.device_floor is not None and backend.device_floor > 0
            peak_device = backend.peak_device()
            assert peak_device is not None
            assert backend.peak_reserved() <= peak_device < backend.peak_reserved() + 64 * MiB
        env = backend.environment()
        assert env["allocator"] == torch.cuda.get_allocator_backend()
        print("environment:", env, "nvml:", backend.nvml_note or "sampling")
        assert env["gpu"] == torch.cuda.get_device_name(backend.index)
    finally:
        backend.close()


def test_real_cuda_plugin_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        from pytest_vram import max_vram

        @max_vram("64MiB")
        def test_fits(vram):
            assert vram.backend == "cuda"
            x = torch.empty(4 * 1024 * 1024, device=vram.device)  # 16 MiB

        @max_vram("8MiB")
        def test_over(vram):
            x = torch.empty(4 * 1024 * 1024, device=vram.device)

        # Above the floor: the context and cuBLAS handle are not this test's.
        @max_vram("64MiB", metric="device")
        def test_nvml_budget(vram):
            x = torch.empty(1024, device=vram.device)

        def test_oom(vram):
            free, total = torch.cuda.mem_get_info()
            x = torch.empty(total * 2, dtype=torch.uint8, device=vram.device)

        def test_after_oom(vram):
            assert torch.cuda.memory_allocated() == 0
            x = torch.ones(256, device=vram.device)

        def test_leak(vram):
            kept = []
            vram.leak_check(lambda: kept.append(torch.ones(128, device=vram.device)),
                            tolerance="0B")
        """
    )
    result = pytester.runpytest("--vram-backend=cuda", "--vram-report", "-p", "no:randomly")
    print(result.stdout.str())
    result.stdout.fnmatch_lines(
        [
            "*peak allocated memory 16.00 MiB exceeds max_vram(8.00 MiB) by 8.00 MiB*",
            "*vram allocator state*",
            "*::test_fits * cuda * 16.00 MiB * 16.00 MiB * 0 B * new",
            "*::test_after_oom * cuda * 1.00 KiB * 1.00 KiB * 0 B * new",
        ],
        consecutive=False,
    )
    outcomes = result.parseoutcomes()
    assert outcomes["failed"] == 3  # over budget, OOM, leak
    assert outcomes["passed"] == 3


def test_real_cuda_snapshot_on_fail(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_earlier(vram):
            kept = [torch.ones(1024, device=vram.device) for _ in range(8)]

        def test_fails(vram):
            x = torch.ones(1024, device=vram.device)
            assert False
        """
    )
    result = pytester.runpytest(
        "--vram-backend=cuda", "--vram-snapshot-on-fail=snaps", "-p", "no:randomly"
    )
    result.assert_outcomes(passed=1, failed=1)
    (snapshot,) = (pytester.path / "snaps").iterdir()
    assert snapshot.suffix == ".pickle" and snapshot.stat().st_size > 0
    # The failing test's own history: none of the earlier test's allocations.
    data = pickle.loads(snapshot.read_bytes())
    frames = [
        frame.get("name")
        for trace in data["device_traces"]
        for entry in trace
        for frame in entry.get("frames", [])
    ]
    assert "test_fails" in frames
    assert "test_earlier" not in frames
    # Off once the run ended: turning it off dropped the history.
    assert not any(torch.cuda.memory._snapshot()["device_traces"])
