"""Stale baseline entries: listed and pruned only where the run can tell that a test is gone,
never because a collection filter left it out."""

from __future__ import annotations

import pytest
import yaml

CPU = "--vram-backend=cpu"

TESTS = """
import pytest, torch

def test_alpha(vram):
    x = torch.ones(1024)

@pytest.mark.gpu_heavy
def test_beta(vram):
    x = torch.ones(2048)

def test_gamma(vram):
    x = torch.ones(4096)
    assert {fail}
"""


def entries(pytester: pytest.Pytester) -> set[str]:
    path = pytester.path / "baselines" / "cpu.yaml"
    return set(yaml.safe_load(path.read_text())["tests"])


@pytest.fixture
def recorded(pytester: pytest.Pytester) -> set[str]:
    pytester.makeini("[pytest]\nmarkers =\n    gpu_heavy: big\n")
    pytester.makepyfile(test_mem=TESTS.format(fail="True"))
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=3)
    # gamma now fails once, so that --lf has something to rerun.
    pytester.makepyfile(test_mem=TESTS.format(fail="False"))
    pytester.runpytest(CPU).assert_outcomes(passed=2, failed=1)
    return entries(pytester)


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["--lf"], id="last-failed"),
        pytest.param(["--deselect", "test_mem.py::test_beta"], id="deselect"),
        pytest.param(["-k", "gamma"], id="keyword"),
        pytest.param(["-m", "not gpu_heavy"], id="marker"),
        pytest.param(["test_mem.py::test_gamma"], id="node-id"),
    ],
)
def test_filtered_tests_are_neither_listed_nor_pruned(
    pytester: pytest.Pytester, recorded: set[str], args: list[str]
) -> None:
    result = pytester.runpytest(CPU, "--vram-report", "--vram-prune-baselines", *args)
    result.stdout.no_fnmatch_line("*no test any more*")
    result.stdout.no_fnmatch_line("*removed in*")
    assert entries(pytester) == recorded


def test_a_plugin_that_drops_tests_in_modifyitems_does_not_make_them_stale(
    pytester: pytest.Pytester, recorded: set[str]
) -> None:
    pytester.makeconftest(
        """
        def pytest_collection_modifyitems(items):
            items[:] = [item for item in items if "alpha" not in item.name]
        """
    )
    pytester.runpytest(CPU, "--vram-report", "--vram-prune-baselines")
    assert entries(pytester) == recorded


def test_a_removed_test_is_listed_and_pruned(pytester: pytest.Pytester, recorded: set[str]) -> None:
    pytester.makepyfile(
        test_mem=TESTS.format(fail="True").replace("def test_beta", "def helper_beta")
    )
    result = pytester.runpytest(CPU, "--vram-report")
    result.stdout.fnmatch_lines(["*no test any more*", "  test_mem.py::test_beta"])
    pytester.runpytest(CPU, "--vram-prune-baselines")
    assert entries(pytester) == recorded - {"test_mem.py::test_beta"}
