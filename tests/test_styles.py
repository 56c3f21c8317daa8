"""Every style of test is judged from pytest's own report of it: ``unittest.TestCase`` tests
(whose failures pytest stores instead of raising), subtests (pytest's ``subtests`` fixture and
``self.subTest``) and xfail markers. A test that reads values on the simulated device passes as
it does without the plugin, each subtest reported once; a failing test of any style is failed
in every report and never stored."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

# pytest's own subtests fixture, which these files use, is new in pytest 9.
pytestmark = [
    pytest.mark.skipif(
        pytest.version_tuple < (9,), reason="the subtests fixture is new in pytest 9"
    ),
    # What becomes of any test the simulated device runs, opted in or not.
    pytest.mark.usefixtures("every_test_simulated"),
]

# Each test reads tensor values, which the simulated device computes only on demand.
READS_VALUES = """
import unittest

import torch


class TestValues(unittest.TestCase):
    def test_value(self):
        self.assertTrue(bool((torch.ones(3) > 0).all()))

    def test_value_in_subtests(self):
        for n in (1, 2, 3):
            with self.subTest(n=n):
                self.assertTrue(bool((torch.ones(n) > 0).all()))


def test_value_in_subtests_fixture(subtests):
    for n in (1, 2, 3):
        with subtests.test(n=n):
            assert bool((torch.ones(n) > 0).all())
"""

# Each test but the last fails, in its own style.
FAILING = """
import unittest

import pytest
import torch



class TestFails(unittest.TestCase):
    def test_fails(self):
        self.assertEqual(torch.ones(4).shape, (5,))

    def test_a_subtest_fails(self):
        for n in (1, 2):
            with self.subTest(n=n):
                self.assertEqual(torch.ones(n).shape, (1,))


def test_a_subtest_fixture_fails(subtests):
    for n in (1, 2):
        with subtests.test(n=n):
            assert torch.ones(n).shape == (1,)


@pytest.mark.xfail(strict=True)
def test_strict_xpass():
    torch.ones(4)


def test_passes():
    torch.ones(4)
"""


def summary(result: pytest.RunResult) -> dict[str, int]:
    """The counts of the run's last line: passed, failed, subtests and so on (the passed
    subtests are counted under -q, which the runs pass)."""
    return {k: v for k, v in result.parseoutcomes().items() if k not in ("warning", "warnings")}


def test_tests_that_read_values_pass_in_every_style(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_reads=READS_VALUES)
    plain = summary(pytester.runpytest("-p", "no:vram", "-q"))
    assert plain == {"passed": 3, "subtests": 6}
    assert summary(pytester.runpytest("--vram-report", "-q", "--cache-clear")) == plain
    result = pytester.runpytest("--vram-report", "-v", "--cache-clear", "--vram-json=figures.json")
    output = result.stdout.str()
    # The shape-only attempts are withdrawn: each subtest has one outcome, and nothing of
    # theirs is printed.
    for n in (1, 2, 3):
        assert output.count(f"test_value_in_subtests_fixture SUBPASSED(n={n})") == 1, output
    assert "DataDependentOutputException" not in output
    records = json.loads(Path(pytester.path, "figures.json").read_text())["tests"]
    assert sorted((r["outcome"], r["status"]) for r in records) == [("passed", "new")] * 3


def test_reading_values_is_remembered_for_unittest_files(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_reads=READS_VALUES)
    pytester.runpytest("--vram-report").assert_outcomes(passed=3)
    cache = pytester.path / ".pytest_cache/v/vram/needs_values"
    assert json.loads(cache.read_text()) == ["test_reads.py"]
    assert summary(pytester.runpytest("--vram-report", "-q")) == {"passed": 3, "subtests": 6}


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_a_failing_test_of_any_style_is_failed_and_never_stored(
    pytester: pytest.Pytester, backend: str
) -> None:
    pytester.makepyfile(test_failing=FAILING)
    plain = summary(pytester.runpytest("-p", "no:vram", "-q"))
    result = pytester.runpytest(
        "-q",
        f"--vram-backend={backend}",
        "--vram-report",
        "--vram-update-baselines",
        "--vram-baseline-dir=baselines",
        "--vram-json=figures.json",
        "--junitxml=junit.xml",
    )
    assert summary(result) == plain
    # Two tests, two subtests and the strict XPASS (pytest counts the TestCase whose subtest
    # failed as passed, its subtest as failed).
    assert plain["failed"] == 5
    records = {
        r["nodeid"].split("::")[-1]: (r["outcome"], r["status"])
        for r in json.loads(Path(pytester.path, "figures.json").read_text())["tests"]
    }
    assert records == {
        "test_fails": ("failed", "failed"),
        "test_a_subtest_fails": ("failed", "failed"),
        "test_a_subtest_fixture_fails": ("failed", "failed"),
        "test_strict_xpass": ("failed", "failed"),
        "test_passes": ("passed", "ok"),
    }
    stored = yaml.safe_load(next((pytester.path / "baselines").glob("*.yaml")).read_text())
    assert list(stored["tests"]) == ["test_failing.py::test_passes"]
    report = result.stdout.str().split("vram report", 1)[1]
    for name, (_, status) in records.items():
        assert any(name in line and line.rstrip().endswith(status) for line in report.splitlines())
    statuses = {
        case.get("name"): {
            prop.get("value") for prop in case.iter("property") if prop.get("name") == "vram_status"
        }
        for case in ET.parse(pytester.path / "junit.xml").getroot().iter("testcase")
    }
    assert statuses["test_passes"] == {"ok"}
    assert all(statuses[name] == {"failed"} for name in records if name != "test_passes")


def test_values_off_say_what_to_do_in_one_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_reads=READS_VALUES)
    result = pytester.runpytest("--vram-report", "--vram-sim-compute=never")
    output = result.stdout.str()
    # The test and each subtest fail, at the line that read the value, and say which option
    # computes it; no traceback through the fake tensors.
    for line in (8, 13, 19):
        message = f"test_reads.py:{line}: reads a tensor's value (aten._local_scalar_dense.default)"
        assert message in output
    assert output.count("--vram-sim-compute=always") >= 7
    assert "fake_tensor.py" not in output
    assert "Traceback" not in output
    assert "DataDependentOutputException" not in output
