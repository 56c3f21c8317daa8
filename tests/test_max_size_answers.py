"""vram.max_size answers honestly, or fails saying why it cannot: a step whose memory stops
growing, one that catches its own out-of-memory error, one that leaks between attempts, a
simulated card smaller than the capacity asked for, a size whose bytes overflow."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from fake_gpu import FakeAllocator

from pytest_vram.backends.cuda.backend import CudaBackend
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.fit import max_size
from pytest_vram.fit.maxsize import check_arguments
from pytest_vram.fit.search import NoAnswer, largest
from pytest_vram.fit.trials import CudaTrials
from pytest_vram.units import SizeError

pytest_plugins = ["fake_gpu_fixtures"]

MiB = 1 << 20


@pytest.fixture
def sim():
    backend = SimBackend()
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.end_test()


def grows(batch: int) -> None:
    """A step that needs a MiB a sample."""
    torch.empty(batch, MiB, dtype=torch.uint8, device="cuda")


# -- a step whose memory stops growing ---------------------------------------------------------


def test_the_search_without_hi_stops_at_its_ceiling() -> None:
    calls: list[int] = []

    def always(n: int) -> bool:
        calls.append(n)
        return True

    with pytest.raises(NoAnswer, match="fits at every size up to 1000"):
        largest(always, 1, None, ceiling=1000)
    assert max(calls) == 1000 and len(calls) == 11
    # Below the ceiling the answer is the search's as before; hi overrides the ceiling.
    assert largest(lambda n: n <= 700, 1, None, ceiling=1000) == 700
    assert largest(always, 1, 5000, ceiling=1000) == 5000


def test_a_step_whose_memory_stops_growing_fails_naming_hi(sim: SimBackend) -> None:
    def flat(batch: int) -> None:
        torch.empty(min(batch, 8), MiB, dtype=torch.uint8, device="cuda")

    with pytest.raises(NoAnswer) as info:
        max_size(sim, flat, "64MiB")
    message = str(info.value)
    assert "step(batch) fits 64.00 MiB at every batch tried, up to 67108865" in message
    assert "hi=" in message
    assert max_size(sim, flat, "64MiB", hi=300).value == 300


# -- a refused allocation ------------------------------------------------------------------------


def test_an_out_of_memory_error_the_step_catches_still_does_not_fit(sim: SimBackend) -> None:
    def catches(batch: int) -> None:
        # A step that retries smaller, or logs and goes on.
        with contextlib.suppress(torch.OutOfMemoryError):
            grows(batch)

    clean = max_size(sim, grows, "100MiB", hi=4096)
    caught = max_size(sim, catches, "100MiB", hi=4096)
    assert caught.value == clean.value == 100
    assert caught.peak == clean.peak == 100 * MiB


def test_fake_cuda_an_out_of_memory_error_the_step_catches_does_not_fit(
    make_backend: Callable[..., CudaBackend], fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    backend = make_backend()

    def catches(batch: int) -> None:
        fake_cuda.num_ooms += 1  # the allocator refused, and the step went on

    trials = CudaTrials(backend)
    assert trials.attempt(lambda batch: None, 4, None, breakdown=False).fits
    assert not trials.attempt(catches, 4, None, breakdown=False).fits


# -- a step that leaks between attempts ----------------------------------------------------------


def test_a_step_that_leaks_between_attempts_fails_naming_what_each_left(sim: SimBackend) -> None:
    kept: list[torch.Tensor] = []

    def leaks(batch: int) -> None:
        kept.append(torch.empty(8 * MiB, dtype=torch.uint8, device="cuda"))
        grows(batch)

    with pytest.raises(NoAnswer, match=r"step\(1\) left 8\.00 MiB more allocated each time"):
        max_size(sim, leaks, "128MiB")


def test_state_a_step_keeps_once_is_where_every_attempt_starts(sim: SimBackend) -> None:
    model = torch.nn.Linear(1024, 1024, device="cuda")  # 4 MiB of weights, and 4 of gradients

    def keeps_gradients(batch: int) -> None:
        model(torch.randn(batch, 256, 1024, device="cuda")).sum().backward()

    def frees_them(batch: int) -> None:
        keeps_gradients(batch)
        model.zero_grad(set_to_none=False)  # zeroed, still allocated: the same state

    kept = max_size(sim, keeps_gradients, "64MiB")
    model.grad = None
    model.weight.grad = model.bias.grad = None
    assert kept.value == max_size(sim, frees_them, "64MiB").value


# -- a simulated card smaller than the capacity ----------------------------------------------------


@pytest.mark.parametrize(
    "card", [{"gpu": "NVIDIA GeForce RTX 4090"}, {"capacity": "24GB"}], ids=["gpu", "capacity"]
)
def test_the_capacity_asked_for_is_searched_whatever_the_simulated_card(card: dict) -> None:
    def step(batch: int) -> None:
        torch.empty(batch, 1000**3, dtype=torch.uint8, device="cuda")

    answers = []
    for backend in (SimBackend(), SimBackend(**card)):
        backend.begin_test()
        try:
            answers.append(max_size(backend, step, "80GB"))
        finally:
            backend.end_test()
    plain, on_card = answers
    assert on_card.value == plain.value == 79
    assert on_card.next_peak == plain.next_peak and on_card.next_peak > 80 * 1000**3


# -- sizes past 64 bits ----------------------------------------------------------------------------


def test_a_size_whose_bytes_overflow_does_not_fit(sim: SimBackend) -> None:
    def huge(batch: int) -> None:
        torch.empty(batch, 2**40, dtype=torch.uint8, device="cuda")

    result = max_size(sim, huge, 2**62)
    assert result.value == 2**22
    assert result.tried[2**23] is None


def test_a_capacity_past_a_64_bit_byte_count_is_refused() -> None:
    assert check_arguments(2**63 - 1, 1, None) == 2**63 - 1
    for capacity in (2**63, "10000000TB"):
        with pytest.raises(SizeError, match="more than a 64-bit byte count"):
            check_arguments(capacity, 1, None)


# -- in a pytest run -------------------------------------------------------------------------------

STEPS = """
import torch

MiB = 1 << 20


def test_flat(vram):
    vram.max_size(lambda batch: torch.empty(MiB, device="cuda"), "1GB")


def test_catches(vram):
    def step(batch):
        try:
            torch.empty(batch, MiB, dtype=torch.uint8, device="cuda")
        except torch.OutOfMemoryError:
            pass

    print("caught:", vram.max_size(step, "100MiB", hi=4096).describe())


kept = []


def test_leaks(vram):
    def step(batch):
        kept.append(torch.empty(8 * MiB, dtype=torch.uint8, device="cuda"))
        torch.empty(batch, MiB, dtype=torch.uint8, device="cuda")

    vram.max_size(step, "128MiB")


def test_card(vram):
    def step(batch):
        torch.empty(batch, 1000**3, dtype=torch.uint8, device="cuda")

    print("card:", vram.max_size(step, "80GB").describe())


def test_overflow(vram):
    def step(batch):
        torch.empty(batch, 2**40, dtype=torch.uint8, device="cuda")

    print("overflow:", vram.max_size(step, 2**62).value)


def test_past_64_bits(vram):
    vram.max_size(lambda batch: None, 2**63)
"""


@pytest.mark.parametrize("card", [[], ["--vram-sim-gpu=NVIDIA GeForce RTX 4090"]])
def test_each_answer_or_its_reason_in_a_run(pytester: pytest.Pytester, card: list[str]) -> None:
    pytester.makepyfile(test_steps=STEPS)
    result = pytester.runpytest("--vram-backend=sim", "-s", *card)
    result.assert_outcomes(passed=3, failed=3)
    result.stdout.fnmatch_lines_random(
        [
            "*vram.max_size: step(batch) fits 1 GB at every batch tried, up to 1000000001: its "
            "memory does not grow with batch*Give hi=*",
            "*caught: largest batch that fits 100.00 MiB: 100 (at 100: 100.00 MiB; 101 needs*",
            "*vram.max_size: step(1) left 8.00 MiB more allocated each time it ran*",
            "*card: largest batch that fits 80 GB: 79 (at 79: 73.58 GiB; 80 needs 74.51 GiB*",
            "*overflow: 4194304",
            "*test_past_64_bits*invalid size 9223372036854775808*more than a 64-bit byte count*",
        ]
    )
    assert "this host has not the memory" not in result.stdout.str()
