"""What the plugin says outside its report: the session header, its warning category, and the
``pytest-vram`` command's version."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

import pytest_vram
from pytest_vram.errors import VramWarning

CPU = "--vram-backend=cpu"

UNCHECKED = """
import pytest
import torch

@pytest.mark.max_vram("1GB", metric="reserved")
def test_reserved_budget(vram):
    torch.ones(256, device=vram.device)

def test_plain(vram):
    torch.ones(256, device=vram.device)
"""


def test_the_warning_category_is_a_pytest_warning() -> None:
    assert issubclass(VramWarning, pytest.PytestWarning)
    assert pytest_vram.VramWarning is VramWarning


def test_a_figure_not_checked_is_a_warning_at_the_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_budget=UNCHECKED)
    result = pytester.runpytest(CPU)
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(
        [
            "test_budget.py::test_reserved_budget",
            "  test_budget.py:4: VramWarning: max_vram(953.67 MiB (1GB), metric='reserved') "
            "not checked: the cpu backend does not measure reserved memory",
        ]
    )


def test_the_warning_can_be_silenced(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_budget=UNCHECKED)
    result = pytester.runpytest(CPU, "-W", "ignore::pytest_vram.VramWarning")
    result.assert_outcomes(passed=2)
    assert "VramWarning" not in result.stdout.str()


def test_the_warning_escalated_fails_the_test_it_is_about(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_budget=UNCHECKED)
    result = pytester.runpytest(CPU, "-W", "error::pytest_vram.VramWarning", "--vram-report")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(
        [
            "*metric='reserved') not checked: the cpu backend does not measure reserved memory "
            "(VramWarning, an error under -W)",
            "FAILED test_budget.py::test_reserved_budget*",
        ]
    )
    result.stdout.fnmatch_lines(["test_budget.py::test_reserved_budget * failed"])


def test_a_stale_entry_is_a_warning_and_escalated_fails_the_run(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_budget=UNCHECKED)
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=2, warnings=1)
    pytester.makepyfile(test_budget=UNCHECKED.replace("def test_plain", "def test_renamed"))
    result = pytester.runpytest(CPU, "--vram-report")
    result.assert_outcomes(passed=2, warnings=2)
    result.stdout.fnmatch_lines(
        [
            "  baselines/cpu.yaml:1: VramWarning: 1 baseline entry has no test any more "
            "(test_budget.py::test_plain); --vram-prune-baselines removes it"
        ]
    )
    assert result.ret == 0
    escalated = pytester.runpytest(
        CPU, "--vram-report", "-W", "error::pytest_vram.VramWarning", "-k", "test_renamed"
    )
    escalated.stdout.fnmatch_lines(
        ["pytest-vram: error: 1 baseline entry has no test any more*(VramWarning, an error*"]
    )
    assert escalated.ret == pytest.ExitCode.TESTS_FAILED


def test_baselines_from_another_environment_are_a_warning(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_budget=UNCHECKED.replace('"1GB", metric="reserved"', '"1GB"'))
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=2)
    path = pytester.path / "baselines" / "cpu.yaml"
    document = yaml.safe_load(path.read_text())
    now = document["environment"]["torch"]
    document["environment"]["torch"] = "2.6.0"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    result = pytester.runpytest(CPU)
    result.assert_outcomes(passed=2, warnings=1)
    result.stdout.fnmatch_lines(
        [
            f"  baselines/cpu.yaml:1: VramWarning: the baselines in cpu.yaml were measured in "
            f"another environment "
            f"(torch 2.6.0 -> {now}); update them with --vram-update-baselines*"
        ]
    )
    rerecorded = pytester.runpytest(CPU, "--vram-update-baselines")
    rerecorded.assert_outcomes(passed=2)
    assert pytester.runpytest(CPU).parseoutcomes().get("warnings") is None


def test_the_header_names_backend_device_class_and_baseline_file(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_budget=UNCHECKED)
    result = pytester.runpytest(CPU, "--vram-report")
    result.stdout.fnmatch_lines(
        [
            "vram: backend cpu (--vram-backend=cpu), device class 'cpu', "
            "baselines baselines/cpu.yaml (0 entries)",
        ]
    )
    pytester.runpytest(CPU, "--vram-update-baselines")
    again = pytester.runpytest(CPU, "--vram-report")
    again.stdout.fnmatch_lines(["vram: backend cpu *baselines/cpu.yaml (2 entries)"])


def test_an_unmeasured_run_has_no_header_line(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    result = pytester.runpytest()
    result.assert_outcomes(passed=1)
    assert "vram:" not in result.stdout.str()


def test_an_update_that_changes_nothing_says_so(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_budget=UNCHECKED.replace('"1GB", metric="reserved"', '"1GB"'))
    first = pytester.runpytest(CPU, "--vram-update-baselines")
    first.stdout.fnmatch_lines(["pytest-vram: baselines: 2 added, 0 updated, 0 removed*"])
    second = pytester.runpytest(CPU, "--vram-update-baselines")
    second.stdout.fnmatch_lines(
        ["pytest-vram: baselines: no change in baselines (2 tests measured, figures as stored)"]
    )


@pytest.mark.parametrize(
    "command",
    [[sys.executable, "-m", "pytest_vram"], ["pytest-vram"]],
    ids=["python -m pytest_vram", "pytest-vram"],
)
def test_the_command_tells_its_version(command: list[str]) -> None:
    bindir = sys.executable.rsplit("/", 1)[0]
    if command[0] == "pytest-vram":
        command = [f"{bindir}/pytest-vram"]
    done = subprocess.run(
        [*command, "--version"], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"pytest-vram {pytest_vram.__version__}"


def test_python_m_runs_the_subcommands() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pytest_vram", "estimate", "--params", "1e9", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert '"parameters": 1000000000' in done.stdout
