"""Every stored figure is the same whatever ran before the test: run alone, in the suite, in
reverse order or under pytest-xdist, the baseline files come out byte for byte the same."""

from __future__ import annotations

import pytest
import yaml

from pytest_vram.backends.segments import (
    LARGE_SEGMENT,
    SMALL_SEGMENT,
    CachingAllocatorModel,
    OwnSegments,
)

MiB = 1 << 20

TESTS = """
import pytest, torch

DEV = {device!r}

@pytest.fixture(scope="module")
def weights():
    scratch = torch.empty(4 * 1024 * 1024, device=DEV)  # 16 MiB, only to make it
    return torch.empty(1024 * 1024, device=DEV)  # 4 MiB

@pytest.fixture(scope="module")
def small():
    return torch.empty(1000, device=DEV)

@pytest.fixture(scope="module")
def model():
    return torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU()).to(DEV)

def test_makes_weights(vram, weights):
    x = torch.empty(256 * 1024, device=DEV)  # 1 MiB

def test_uses_no_fixture(vram):
    x = torch.empty(2 * 1024 * 1024, device=DEV)  # 8 MiB

def test_uses_both(vram, weights, small):
    x = torch.empty(1000, device=DEV)

def test_scenarios(vram, small):
    x = torch.empty(3 * 1024 * 1024, device=DEV)  # 12 MiB
    vram.empty_cache()
    vram.single_step(lambda: torch.empty(1000, device=DEV))
    vram.leak_check(lambda: torch.empty(1000, device=DEV), steps=3, warmup=1)

def test_forward(vram, model):
    model(torch.ones(64, 512, device=DEV)).sum()

def test_forward_small(vram, model):
    model(torch.ones(8, 512, device=DEV))

def test_reads_values(vram, weights):
    y = torch.ones(300 * 1024, device=DEV)
    assert (y[:10] + 1).sum().item() == 20.0
"""

REVERSE = """
def pytest_collection_modifyitems(items):
    items.reverse()
"""


def write_suite(pytester: pytest.Pytester, backend: str) -> list[str]:
    pytester.makepyfile(test_suite=TESTS.format(device="cpu" if backend == "cpu" else "cuda"))
    pytester.makepyfile(reverse_order=REVERSE)
    pytester.syspathinsert()
    result = pytester.runpytest("--collect-only", "-q", "-p", "no:randomly")
    return [line for line in result.outlines if "::" in line]


def baselines(pytester: pytest.Pytester, backend: str, name: str, *args: str) -> bytes:
    """The baseline file that ``--vram-update-baselines`` writes for a run with ``args``."""
    directory = pytester.path / f"baselines-{name}"
    result = pytester.runpytest(
        f"--vram-backend={backend}",
        "--vram-update-baselines",
        "--vram-breakdown",
        f"--vram-baseline-dir={directory}",
        "-p",
        "no:randomly",
        *args,
    )
    assert result.ret == 0, result.outlines
    (path,) = directory.glob("*.yaml")
    return path.read_bytes()


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_serial_xdist_alone_and_reversed_write_the_same_baselines(
    pytester: pytest.Pytester, backend: str
) -> None:
    pytest.importorskip("xdist")
    nodeids = write_suite(pytester, backend)
    assert len(nodeids) == 7, nodeids
    serial = baselines(pytester, backend, "serial")
    assert baselines(pytester, backend, "xdist", "-n", "2") == serial
    assert baselines(pytester, backend, "reversed", "-p", "reverse_order") == serial
    for nodeid in nodeids:  # one file, each entry written by a run of its test alone
        alone = baselines(pytester, backend, "alone", nodeid)
    assert alone == serial


def test_reserved_is_the_tests_own_whichever_test_made_the_fixture(
    pytester: pytest.Pytester,
) -> None:
    write_suite(pytester, "sim")

    def reserved(name: str, *tests: str) -> dict[str, int]:
        stored = yaml.safe_load(baselines(pytester, "sim", name, *tests))["tests"]
        return {nodeid.split("::")[1]: entry["peak_reserved"] for nodeid, entry in stored.items()}

    tests = ("test_makes_weights", "test_uses_both", "test_uses_no_fixture")
    in_suite = reserved("suite", *(f"test_suite.py::{test}" for test in tests))
    alone = reserved("alone", "test_suite.py::test_uses_no_fixture")
    # Its 8 MiB needs one 20 MiB segment, not the one that keeps another test's fixture.
    assert in_suite["test_uses_no_fixture"] == alone["test_uses_no_fixture"] == LARGE_SEGMENT
    # The fixture's 4 MiB needs a 20 MiB segment and the tests' own allocations a 2 MiB one,
    # not the 16 MiB segment that making the fixture left cached, which a test that finds
    # the fixture made never sees.
    assert in_suite["test_makes_weights"] == in_suite["test_uses_both"]
    assert in_suite["test_uses_both"] == LARGE_SEGMENT + SMALL_SEGMENT


def test_own_segments_hold_the_fixtures_then_replay_the_test() -> None:
    device = CachingAllocatorModel()
    other = device.malloc(4 * MiB)  # another test's fixture, in a 20 MiB segment
    own = OwnSegments(device)
    fixture = device.malloc(12 * MiB)  # this test's, in the rest of that segment
    own.start([(fixture, 12 * MiB), (None, 1000)])
    assert own.model is not None
    assert own.model.reserved == 12 * MiB + SMALL_SEGMENT  # as a fresh allocator lays them
    block = own.malloc(2 * MiB)
    # The device fits it in the segment of the other test's fixture; the test alone needs
    # a segment for it.
    assert device.reserved == LARGE_SEGMENT
    assert own.model.reserved == 12 * MiB + SMALL_SEGMENT + LARGE_SEGMENT
    own.free(block)
    own.free(other)  # not the test's: nothing to replay
    own.free(own.malloc(16 * MiB))  # the temporary of making a fixture, left cached
    own.restart()
    assert own.model.reserved == own.model.peak_reserved == 12 * MiB + SMALL_SEGMENT
    own.free(fixture)
    assert own.model.allocated == 1024  # the storage whose frees are not seen here
    own.stop()
    assert own.model is None
