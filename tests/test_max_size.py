"""vram.max_size: the search, what fits on the simulated device, and the figure a baseline keeps."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_verdict import settings

from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.baselines.compare import compare_with_entry
from pytest_vram.fit import largest, max_size
from pytest_vram.fit.sweep import sweep
from pytest_vram.fit.trials import SimTrials
from pytest_vram.marks import VramMarks
from pytest_vram.record.record import TestRecord, read_record
from pytest_vram.record.status import Status
from pytest_vram.units import parse_tolerance
from pytest_vram.verdict import judge

MiB = 1 << 20


# -- the search ---------------------------------------------------------------------------------


@pytest.mark.parametrize("lo", [1, 3, 64])
def test_search_finds_what_a_scan_of_every_value_finds(lo: int) -> None:
    for threshold, hi in itertools.product(range(lo - 1, lo + 70), (None, lo + 40)):
        calls: list[int] = []

        def fits(n: int, threshold: int = threshold, calls: list[int] = calls) -> bool:
            calls.append(n)
            return n <= threshold

        scanned = max([n for n in range(lo, (hi or lo + 80) + 1) if fits(n)], default=lo - 1)
        calls.clear()
        assert largest(fits, lo, hi) == scanned
        # Doubling, then halving the gap: logarithmic in the answer, not linear.
        assert len(calls) <= 2 * max(threshold, lo).bit_length() + 2


def test_search_refuses_bounds_that_hold_nothing() -> None:
    with pytest.raises(ValueError, match="lo must be at least 1"):
        largest(lambda n: True, 0)
    with pytest.raises(ValueError, match="hi must be at least lo"):
        largest(lambda n: True, 5, 4)


# -- on the simulated device -------------------------------------------------------------------


@pytest.fixture
def sim():
    backend = SimBackend()
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.end_test()


def mlp_step(width: int = 512):
    """A training step of a small MLP whose activations grow with the batch."""
    model = torch.nn.Sequential(
        torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width)
    ).to("cuda")

    def step(batch: int) -> None:
        optimizer = torch.optim.AdamW(model.parameters())
        model(torch.randn(batch, 64, width, device="cuda")).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def scan(backend: SimBackend, step, capacity: int, last: int) -> int:
    """The largest batch that fits, by running every batch from 1 under the capacity."""
    trials = SimTrials(backend)
    fitting = [
        n for n in range(1, last + 1) if trials.attempt(step, n, capacity, breakdown=False).fits
    ]
    assert fitting == list(range(1, len(fitting) + 1)), "memory should grow with the batch"
    return len(fitting)


@pytest.mark.parametrize("capacity", [64 * MiB, 96 * MiB, 160 * MiB])
def test_max_size_agrees_with_a_scan_of_every_batch(sim: SimBackend, capacity: int) -> None:
    step = mlp_step()
    result = max_size(sim, step, capacity)
    assert result.value == scan(sim, step, capacity, result.value + 3)
    assert result.knob == "batch"
    assert result.peak is not None and result.peak <= capacity
    assert result.next_peak is not None and result.next_peak > capacity
    assert result.grew is not None and result.grew["activations"] > 0


def test_a_capacity_just_below_the_reserved_peak_raises_and_at_it_fits(sim: SimBackend) -> None:
    def step(batch: int) -> None:
        # Everything stays alive to the end: no cached block the allocator's retry could free.
        kept = [torch.empty(batch, 3 * MiB + 512, dtype=torch.uint8, device="cuda")]
        kept += [torch.empty(batch, 1000, device="cuda") for _ in range(5)]

    trials = SimTrials(sim)
    device_before = sim.segments.allocated
    whole = trials.attempt(step, 8, None, breakdown=False)
    assert whole.fits
    at = trials.attempt(step, 8, whole.peak, breakdown=False)
    below = trials.attempt(step, 8, whole.peak - 1, breakdown=False)
    assert at.fits and at.peak == whole.peak
    assert not below.fits and below.cut_short
    # The failed attempt left nothing behind: the next one finds the device as before.
    assert sim.segments.allocated == device_before
    assert trials.attempt(step, 8, None, breakdown=False).peak == whole.peak
    assert max_size(sim, step, whole.peak).value == 8


def test_the_answer_fits_a_capacity_of_its_own_peak(sim: SimBackend) -> None:
    step = mlp_step()
    result = max_size(sim, step, 96 * MiB)
    assert result.peak is not None
    assert SimTrials(sim).attempt(step, result.value, result.peak, breakdown=False).fits


def test_the_allocators_retry_counts_as_fitting(sim: SimBackend) -> None:
    """A step whose cached blocks make the reserved peak exceed the capacity still fits when
    freeing the cache, as PyTorch does before it raises, makes room."""

    def step(batch: int) -> None:
        kept = []
        for _ in range(batch):
            scratch = torch.empty(30 * MiB, dtype=torch.uint8, device="cuda")
            del scratch  # cached: a 30 MiB segment no later request of 31 MiB can use
            kept.append(torch.empty(31 * MiB, dtype=torch.uint8, device="cuda"))

    trials = SimTrials(sim)
    whole = trials.attempt(step, 3, None, breakdown=False)
    assert whole.peak == 3 * 32 * MiB + 30 * MiB  # the cached 30 MiB segment counts
    assert trials.attempt(step, 3, 3 * 32 * MiB, breakdown=False).fits
    assert not trials.attempt(step, 3, 3 * 32 * MiB - 1, breakdown=False).fits


def test_one_sweep_answers_every_capacity_as_separate_searches_do(sim: SimBackend) -> None:
    step = mlp_step()
    capacities = [64 * MiB, 96 * MiB, 160 * MiB]
    runs: list[int] = []
    table = sweep(SimTrials(sim), step, capacities, on_attempt=lambda n, c, f: runs.append(n))
    assert [fit.value for fit in table] == [max_size(sim, step, c).value for c in capacities]
    assert all(fit.peak is not None and fit.peak <= fit.capacity for fit in table)


# -- the figure and the verdict ------------------------------------------------------------------


def record_with(value: int) -> TestRecord:
    found = {
        "value": value,
        "peak": 77 * 1024 * MiB,
        "next_peak": 80 * 1024 * MiB,
        "capacity": 80_000_000_000,
        "capacity_text": "80 GB",
        "knob": "batch",
        "metric": "reserved",
        "grew": {"activations": 3 * 1024 * MiB, "parameters": 0},
    }
    return TestRecord(
        nodeid="t.py::test_fits", backend="sim", device="sim", scenarios={"max_size": found}
    )


def test_the_largest_size_is_a_stored_figure() -> None:
    record = record_with(12)
    assert record.figures()["max_size"] == 12
    assert read_record(record.to_dict()).figures()["max_size"] == 12


def test_a_lower_largest_size_fails_like_a_regression_and_a_higher_one_improves() -> None:
    entry = {"peak_allocated": 0, "max_size": 12}
    lower = judge(record_with(10), VramMarks(), entry, settings())
    assert lower.status is Status.REGRESSION
    assert lower.failures[0] == (
        "memory regression: largest batch that fits 80 GB: 12 -> 10 (at 10: 77.00 GiB; "
        "11 needs 80.00 GiB: activations +3.00 GiB)"
    )
    assert judge(record_with(13), VramMarks(), entry, settings()).status is Status.IMPROVED
    assert judge(record_with(12), VramMarks(), entry, settings()).status is Status.OK


def test_no_tolerance_lets_the_largest_size_drop() -> None:
    (change,) = compare_with_entry({"max_size": 99}, {"max_size": 100}, parse_tolerance("50%"))
    assert change.regressed and change.describe() == "largest size that fits: 100 -> 99"


# -- in a pytest run -----------------------------------------------------------------------------

FITS = """
import torch

def test_fits(vram):
    model = torch.nn.Linear(1024, 1024, device="cuda")

    def step(batch):
        model(torch.randn(batch, 256, 1024, device="cuda")).sum().backward()

    result = vram.max_size(step, "CAPACITY")
    print("largest:", result.value, result.peak, result.next_peak)
"""


@pytest.mark.slow
def test_the_baseline_keeps_the_largest_batch_and_a_smaller_capacity_fails(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_fits=FITS.replace("CAPACITY", "200MB"))
    stored = pytester.runpytest("--vram-backend=sim", "--vram-update-baselines", "-s")
    stored.assert_outcomes(passed=1)
    baseline = (pytester.path / "baselines" / "sim.yaml").read_text()
    (line,) = [line for line in stored.outlines if "largest:" in line]
    value = int(line.split("largest:")[1].split()[0])
    assert f"max_size: {value}\n" in baseline
    # The same step on a card a third smaller: the largest batch falls, and the test fails.
    pytester.makepyfile(test_fits=FITS.replace("CAPACITY", "140MB"))
    result = pytester.runpytest("--vram-backend=sim")
    result.assert_outcomes(failed=1)
    result.stdout.re_match_lines(
        [rf"memory regression: largest batch that fits 140 MB: {value} -> \d+ \(at \d+: .*MiB"]
    )


def test_a_second_search_in_one_test_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_twice(vram):
            vram.max_size(lambda batch: None, "1GB", hi=2)
            vram.max_size(lambda batch: None, "1GB", hi=2)

        def test_bad_capacity(vram):
            vram.max_size(lambda batch: None, "80GBs")
        """
    )
    result = pytester.runpytest("--vram-backend=sim")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*test_twice*vram.max_size was already called in this test*",
            "*test_bad_capacity*vram.max_size*'80GBs'*",
        ]
    )


def test_the_ranks_largest_size_is_the_smallest_any_rank_fits() -> None:
    from pytest_vram.record.figures import rank_figures

    ranks = [
        {"rank": 0, "figures": {"peak_allocated": 10, "max_size": 12}},
        {"rank": 1, "figures": {"peak_allocated": 30, "max_size": 9}},
    ]
    figures = rank_figures(ranks)
    assert figures["peak_allocated"] == 30 and figures["max_size"] == 9
    assert figures["max_size_rank0"] == 12 and figures["max_size_rank1"] == 9
