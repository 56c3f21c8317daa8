"""A test's own torch.cuda.reset_peak_memory_stats() never hides a spike from its figures.

The test's code reads torch's answers after its reset (the peak starts again); the plugin's
peak, its scenarios' peaks and its counters keep what came before: on sim, on cpu and on cuda
(a faked torch.cuda, tests/fake_gpu.py).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable

import pytest
import torch
from fake_gpu import FakeAllocator, MiB
from test_cuda_backend_fake import run_on_fake_gpu

from pytest_vram.backends.cuda.backend import CudaBackend
from pytest_vram.measure.measurement import TestMeasurement

pytest_plugins = ["fake_gpu_fixtures"]

# Every spelling a test may reset with; each starts torch's peak again.
RESETS = [
    "torch.cuda.reset_peak_memory_stats",
    "torch.cuda.memory.reset_peak_memory_stats",
    "torch.cuda.reset_max_memory_allocated",
    "torch.cuda.memory.reset_max_memory_allocated",
    "torch.cuda.reset_max_memory_cached",
]

SPIKE = """
import warnings

import pytest
import torch

MiB = 1 << 20


@pytest.mark.max_vram("10MiB")
@pytest.mark.parametrize("reset", RESETS)
def test_spike_then_reset(vram, reset):
    spike = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
    del spike
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # reset_max_memory_* are deprecated
        eval(reset)()
    # The test's own code reads torch's answer: the peak starts again.
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
    assert torch.cuda.memory_stats()["allocated_bytes.all.peak"] < MiB


def test_scenarios_keep_their_peaks(vram):
    def step():
        spike = torch.empty(100 * MiB, dtype=torch.uint8, device="cuda")
        del spike
        torch.cuda.reset_peak_memory_stats()
        return torch.empty(MiB, dtype=torch.uint8, device="cuda")

    result = vram.single_step(step)
    assert result.peak - result.before >= 100 * MiB
    with vram.measure() as measured:
        step()
    assert measured.delta >= 100 * MiB
    print("peaks kept:", result.peak - result.before, measured.delta)
""".replace("RESETS", repr(RESETS))


def test_a_tests_own_peak_reset_keeps_the_spike_on_sim(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_spike=SPIKE)
    result = pytester.runpytest("--vram-backend=sim", "-s")
    result.assert_outcomes(failed=len(RESETS), passed=1)
    over = "peak allocated memory 100.00 MiB exceeds max_vram(10.00 MiB) by 90.00 MiB"
    # Once a test in its failure; a CI run (CI=true) repeats it whole in the short summary.
    assert result.stdout.lines.count(over) == len(RESETS)
    result.stdout.fnmatch_lines(["*peaks kept:*"])


def test_a_tests_own_reset_of_the_counters_keeps_them_in_its_figures_on_sim(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        """
        import contextlib

        import torch


        def test_counts(vram):
            with contextlib.suppress(torch.OutOfMemoryError):
                torch.empty(100 << 20, dtype=torch.uint8, device="cuda")
            assert torch.cuda.memory_stats()["num_ooms"] == 1
            torch.cuda.reset_accumulated_memory_stats()
            assert torch.cuda.memory_stats()["num_ooms"] == 0
            assert torch.cuda.memory_stats()["num_alloc_retries"] == 0
        """
    )
    result = pytester.runpytest(
        "--vram-backend=sim", "--vram-sim-capacity=64MiB", "--vram-json=out.json"
    )
    result.assert_outcomes(passed=1)
    (test,) = json.loads((pytester.path / "out.json").read_text())["tests"]
    assert test["counters"]["num_ooms"] == 1
    assert test["counters"]["num_alloc_retries"] == 1


# -- cuda, on the faked torch.cuda ----------------------------------------------------------


def test_fake_cuda_a_tests_own_resets_keep_its_peak_and_counters(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    backend = make_backend()
    reset_by_torch = torch.cuda.reset_peak_memory_stats
    measurement = TestMeasurement(backend, "t.py::test_gpu")
    measurement.begin()
    fake_cuda.malloc(100 * MiB)
    fake_cuda.free(100 * MiB)
    fake_cuda.malloc(1 * MiB)
    fake_cuda.num_ooms += 1
    resets = [
        torch.cuda.reset_peak_memory_stats,
        torch.cuda.memory.reset_peak_memory_stats,
        torch.cuda.reset_max_memory_allocated,
        torch.cuda.memory.reset_max_memory_cached,
        torch.cuda.reset_accumulated_memory_stats,
        torch.cuda.memory.reset_accumulated_memory_stats,
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        for reset in resets:
            reset()
            # What the test's own code reads: torch's figures, reset.
            assert torch.cuda.max_memory_allocated() == 1 * MiB
            assert backend.peak_allocated() == 100 * MiB
    assert torch.cuda.memory_stats()["num_ooms"] == 0
    fake_cuda.num_ooms += 1
    measurement.finish_call()
    fake_cuda.free(1 * MiB)
    measurement.end()
    record = measurement.record
    assert record.peak_allocated == 100 * MiB
    assert record.peak_reserved == 100 * MiB  # its segments stayed cached
    assert record.counters["num_ooms"] == 2
    # After the test, torch's own functions again, and the plugin's next peak is its own.
    assert torch.cuda.reset_peak_memory_stats is reset_by_torch
    backend.reset_peak()
    assert backend.peak_allocated() == 0


SPIKE_ON_THE_DEVICE = """
import pytest
import torch

MiB = 1 << 20


@pytest.mark.max_vram("10MiB")
def test_spike_then_reset(vram, fake_gpu):
    if vram.backend == "cuda":
        fake_gpu.malloc(100 * MiB)
        fake_gpu.free(100 * MiB)
    else:
        spike = torch.empty(100 * MiB, dtype=torch.uint8, device=vram.device)
        del spike
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated()
"""


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["cuda", "cpu"])
def test_fake_cuda_a_tests_own_peak_reset_keeps_the_spike_in_a_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    pytester.makepyfile(test_spike=SPIKE_ON_THE_DEVICE)
    result = run_on_fake_gpu(pytester, monkeypatch, f"--vram-backend={backend}")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*peak allocated memory 100.00 MiB exceeds max_vram(10.00 MiB) by 90.00 MiB*"]
    )
