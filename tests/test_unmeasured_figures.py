"""A figure the baseline stores and the run did not measure fails the test: a scenario the test
no longer runs would otherwise pass unchecked."""

from __future__ import annotations

import pytest
import yaml
from plain_settings import settings

from pytest_vram.baselines.compare import unmeasured_figures
from pytest_vram.marks import VramMarks
from pytest_vram.record.record import TestRecord
from pytest_vram.verdict import judge

CPU = "--vram-backend=cpu"

STEP = """
import torch

def test_step(vram):
    x = torch.ones(1024, device=vram.device)
    def step():
        return torch.ones({n}, device=vram.device)
    {scenario}
"""


def test_unmeasured_figures_are_the_measured_ones_the_entry_has_and_the_run_lacks() -> None:
    entry = {
        "peak_allocated": 10,
        "max_size": 64,
        "single_step_peak_rank1": 5,
        "peak_activations": 3,  # a category absent at the peak held no bytes
    }
    assert unmeasured_figures({"peak_allocated": 10}, entry) == {
        "max_size": 64,
        "single_step_peak_rank1": 5,
    }


def test_a_stored_max_size_the_test_no_longer_finds_fails_with_its_value() -> None:
    record = TestRecord("t.py::t", "sim", "sim", peak_allocated=100)
    verdict = judge(record, VramMarks(), {"peak_allocated": 100, "max_size": 64}, settings())
    assert verdict.status.value == "regression"
    assert verdict.failures == [
        "the baseline stores max_size = 64 and this run did not measure it",
        "if this is intended, update the baseline: pytest --vram-update-baselines t.py::t",
    ]


def test_a_stored_single_step_peak_fails_until_the_baseline_is_updated(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_it=STEP.format(n=4096, scenario="vram.single_step(step)"))
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=1)
    path = pytester.path / "baselines" / "cpu.yaml"
    assert "single_step_peak" in yaml.safe_load(path.read_text())["tests"]["test_it.py::test_step"]

    pytester.makepyfile(test_it=STEP.format(n=4096, scenario="step()"))
    result = pytester.runpytest(CPU)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "the baseline stores single_step_peak = 20.00 KiB and this run did not measure it",
            "if this is intended, update the baseline: pytest --vram-update-baselines "
            "test_it.py::test_step",
        ]
    )
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=1)
    assert (
        "single_step_peak" not in yaml.safe_load(path.read_text())["tests"]["test_it.py::test_step"]
    )
    pytester.runpytest(CPU).assert_outcomes(passed=1)
