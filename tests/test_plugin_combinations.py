"""pytest-vram together with the plugins a suite runs with: pytest-randomly (its per-run seed
must not change a measured test's figures), pytest-rerunfailures (reruns happen, each run
measured, the last one reported), pytest-repeat, pytest-timeout and pytest-xdist."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

# A test whose size comes from Python's and NumPy's generators, which pytest-randomly reseeds
# with a seed of its own, another every run.
RANDOM_SIZE = """
import random

import numpy as np
import torch


def test_random_size(vram):
    n = random.randint(1, 1 << 16) + int(np.random.randint(1, 1 << 16))
    torch.empty(n)
"""

# Fails on its first two runs, allocating more on each: only the last run's figures are right.
FLAKY = """
import torch


def test_flaky(request, vram):
    run = getattr(request.node, "execution_count", 3)  # pytest-rerunfailures counts runs
    torch.empty(1024 * run)
    assert run >= 3
"""


@pytest.fixture
def with_randomly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the pytester runs load pytest-randomly, as a suite that installs it does."""
    pytest.importorskip("pytest_randomly")
    monkeypatch.delenv("PYTEST_ADDOPTS", raising=False)


def stored(directory: Path) -> dict[str, dict[str, int]]:
    return yaml.safe_load((directory / "sim.yaml").read_text())["tests"]


def records(path: Path) -> list[dict]:
    return json.loads(path.read_text())["tests"]


@pytest.mark.usefixtures("with_randomly")
def test_randomly_seeds_do_not_change_the_figures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_random=RANDOM_SIZE)
    found = []
    for seed in (1, 2):
        directory = pytester.path / f"baselines-{seed}"
        result = pytester.runpytest(
            "-p", "randomly", f"--randomly-seed={seed}", "--vram-update-baselines",
            f"--vram-baseline-dir={directory}", "--count=2",
        )  # fmt: skip
        result.assert_outcomes(passed=2)
        assert f"--randomly-seed={seed}" in result.stdout.str()
        found.append(stored(directory))
    assert len(found[0]) == 2  # one entry per repeat (pytest-repeat)
    assert found[0] == found[1]


@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_rerunfailures_reruns_and_the_last_run_is_reported(
    pytester: pytest.Pytester, backend: str
) -> None:
    pytest.importorskip("pytest_rerunfailures")
    pytester.makepyfile(test_flaky=FLAKY)
    options = [f"--vram-backend={backend}", "--vram-report"]
    # Run alone, without reruns: as the last of three runs.
    pytester.runpytest(*options, "--vram-json=alone.json").assert_outcomes(passed=1)
    result = pytester.runpytest(*options, "--reruns=2", "--vram-json=reruns.json")
    assert result.parseoutcomes() == {"passed": 1, "rerun": 2}
    (alone,) = records(pytester.path / "alone.json")
    (rerun,) = records(pytester.path / "reruns.json")
    assert rerun["outcome"] == "passed"
    assert rerun["peak_allocated"] == alone["peak_allocated"]
    report = result.stdout.str().split("vram report", 1)[1]
    assert report.count("test_flaky.py::test_flaky") == 1


def test_timeout_fails_a_measured_test_that_is_not_stored(pytester: pytest.Pytester) -> None:
    pytest.importorskip("pytest_timeout")
    pytester.makepyfile(
        test_slow="""
        import time

        import pytest
        import torch


        def test_reads_values(vram):
            assert bool((torch.ones(3) > 0).all())


        @pytest.mark.timeout(1)
        def test_too_slow(vram):
            torch.ones(3)
            time.sleep(30)
        """
    )
    result = pytester.runpytest(
        "--timeout=60", "--vram-update-baselines", "--vram-baseline-dir=baselines"
    )
    result.assert_outcomes(passed=1, failed=1)
    assert "Timeout" in result.stdout.str()
    assert list(stored(pytester.path / "baselines")) == ["test_slow.py::test_reads_values"]


@pytest.mark.slow
@pytest.mark.usefixtures("with_randomly")
def test_xdist_and_randomly_write_the_figures_of_a_serial_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_random=RANDOM_SIZE, test_flaky=FLAKY)
    found = {}
    runs = {
        "serial": ["-p", "no:randomly"],
        "xdist-1": ["-n", "2", "-p", "randomly", "--randomly-seed=1"],
        "xdist-2": ["-n", "2", "-p", "randomly", "--randomly-seed=2"],
    }
    for name, options in runs.items():
        directory = pytester.path / f"baselines-{name}"
        result = pytester.runpytest_subprocess(
            *options, "--vram-update-baselines", f"--vram-baseline-dir={directory}"
        )
        result.assert_outcomes(passed=2)
        found[name] = stored(directory)
    assert len(found["serial"]) == 2
    assert found["serial"] == found["xdist-1"] == found["xdist-2"]
