"""What is gated: only tests that opted in (a vram marker or fixture) are compared with their
baselines, stored and held to --vram-strict, unless --vram-gate=all; on the simulated device a
test that did not opt in runs as without the plugin."""

from __future__ import annotations

import json
import random

import pytest
import yaml

from pytest_vram.report.terminal import QUIET_ROWS

CPU = "--vram-backend=cpu"
SIM = "--vram-backend=sim"

PLAIN = """
import torch

def test_plain():
    x = torch.ones({n})
    assert x.sum() > 0
"""

SUITE = (
    PLAIN
    + """
from pytest_vram import max_vram

def test_pure():
    assert 1 + 1 == 2

@max_vram("1GiB")
def test_marked():
    x = torch.ones(4096)

def test_fixture(vram):
    x = torch.ones(2048, device=vram.device)
"""
)


def stored(pytester: pytest.Pytester, device: str = "cpu") -> dict[str, dict[str, int]]:
    path = pytester.path / "baselines" / f"{device}.yaml"
    if not path.exists():
        return {}
    return yaml.safe_load(path.read_text())["tests"] or {}


def test_a_plain_test_that_grows_never_fails_the_build(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE.format(n=1000))
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=4)
    assert set(stored(pytester)) == {"test_suite.py::test_marked", "test_suite.py::test_fixture"}

    pytester.makepyfile(test_suite=SUITE.format(n=100_000))
    result = pytester.runpytest(CPU, "--vram-report", "--vram-strict")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(["*::test_plain * cpu * 390.64 KiB * - * - * ungated"])
    result.stdout.fnmatch_lines(["4 measured tests: 2 ok, 2 ungated"])
    result.stdout.no_fnmatch_line("*regression*")


def test_pure_python_tests_pass_strict_under_the_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_pure="\n".join(f"def test_{i}():\n    assert {i} >= 0\n" for i in range(30))
    )
    for backend in (CPU, SIM):
        pytester.runpytest(backend, "--vram-report", "--vram-strict").assert_outcomes(passed=30)
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=30)
    assert stored(pytester) == {}


def test_ungated_tests_are_in_the_json_and_junit_with_their_peak(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_suite=SUITE.format(n=1000))
    result = pytester.runpytest(CPU, "--vram-report", "--vram-json=r.json", "--junitxml=j.xml")
    result.assert_outcomes(passed=4)
    tests = {
        test["nodeid"]: test for test in json.loads((pytester.path / "r.json").read_text())["tests"]
    }
    assert tests["test_suite.py::test_plain"]["status"] == "ungated"
    assert 4000 <= tests["test_suite.py::test_plain"]["peak_allocated"] < 8192
    assert tests["test_suite.py::test_marked"]["status"] == "new"
    junit = (pytester.path / "j.xml").read_text()
    assert 'name="vram_status" value="ungated"' in junit


def test_on_sim_a_test_that_did_not_opt_in_runs_as_without_the_plugin(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_sim_plain="""
        import random
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        STATE = random.getstate()

        def test_plain():
            x = torch.ones(8)
            assert not isinstance(x, FakeTensor)
            assert x.device.type == "cpu"
            assert not torch.cuda.is_available()
            # no reseeding: the state the module left is the one this test sees
            assert random.getstate() == STATE

        def test_marked(vram):
            assert torch.cuda.is_available()
        """
    )
    result = pytester.runpytest(SIM, "--vram-report", "-p", "no:randomly")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(
        [
            "1 measured test: 1 new",
            "1 test not measured: they did not opt in (a vram marker or fixture), and the "
            "simulated device runs only tests that do (--vram-gate=all simulates every test)",
        ]
    )
    data_file = pytester.path / "r.json"
    pytester.runpytest(SIM, "--vram-report", f"--vram-json={data_file}")
    document = json.loads(data_file.read_text())
    assert [test["nodeid"] for test in document["tests"]] == ["test_sim_plain.py::test_marked"]
    assert document["run"]["not_measured"] == 1


def test_a_test_that_did_not_opt_in_after_one_that_did_finds_torch_as_it_was(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(
        test_order="""
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        TO, ONES = torch.Tensor.to, torch.ones

        def test_marked(vram):
            model = torch.nn.Linear(2, 2, device="cuda")
            model(torch.ones(1, 2, device="cuda"))

        def test_plain_after():
            assert not isinstance(torch.ones(8), FakeTensor)
            assert not torch.cuda.is_available()
            assert torch.Tensor.to is TO and torch.ones is ONES
            module = torch.nn.modules.module
            assert not module._global_forward_pre_hooks
            assert not module._global_forward_hooks
        """
    )
    pytester.runpytest(SIM, "--vram-report").assert_outcomes(passed=2)


def test_gate_all_simulates_and_gates_every_test_above_the_floor(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_suite=SUITE.format(n=1000))
    pytester.runpytest(SIM, "--vram-update-baselines", "--vram-gate=all").assert_outcomes(passed=4)
    assert set(stored(pytester, "sim")) == {
        "test_suite.py::test_plain",
        "test_suite.py::test_pure",
        "test_suite.py::test_marked",
        "test_suite.py::test_fixture",
    }
    # 4 KB -> 400 KB: far beyond the tolerance, below the 1 MiB floor.
    pytester.makepyfile(test_suite=SUITE.format(n=100_000))
    pytester.runpytest(SIM, "--vram-report", "--vram-gate=all").assert_outcomes(passed=4)
    # 4 KB -> 4 MB: beyond both.
    pytester.makepyfile(test_suite=SUITE.format(n=1_000_000))
    result = pytester.runpytest(SIM, "--vram-report", "--vram-gate=all")
    result.assert_outcomes(passed=3, failed=1)
    result.stdout.fnmatch_lines(["*memory regression: peak allocated 3.8? MiB against baseline*"])
    # The floor is the ini setting's.
    pytester.makeini("[pytest]\nvram_gate = all\nvram_min_change = 8MiB\n")
    pytester.runpytest(SIM, "--vram-report").assert_outcomes(passed=4)


def test_an_opted_in_test_keeps_the_exact_comparison_under_gate_all(
    pytester: pytest.Pytester,
) -> None:
    test = "def test_fixture(vram):\n    x = torch.ones({n}, device=vram.device)\n"
    pytester.makepyfile(test_one="import torch\n" + test.format(n=100_000))
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=1)
    # +40 KB, +10%: under the floor, over the tolerance.
    pytester.makepyfile(test_one="import torch\n" + test.format(n=110_000))
    result = pytester.runpytest(CPU, "--vram-gate=all")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*memory regression*"])


def test_a_bad_gate_or_floor_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_a="def test_a():\n    pass\n")
    result = pytester.runpytest("--vram-gate=some")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--vram-gate: invalid choice: 'some'*"])
    pytester.makeini("[pytest]\nvram_min_change = lots\n")
    result = pytester.runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*vram_min_change: *lots*"])


def test_entries_of_tests_that_no_longer_opt_in_are_stale(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_suite=SUITE.format(n=1000))
    pytester.runpytest(CPU, "--vram-update-baselines", "--vram-gate=all").assert_outcomes(passed=4)
    result = pytester.runpytest(CPU, "--vram-report")
    result.assert_outcomes(passed=4)
    result.stdout.fnmatch_lines(
        [
            "2 baseline entries belong to tests that no longer opt in (no vram marker or "
            "fixture), never compared (remove them with --vram-prune-baselines):",
            "  test_suite.py::test_plain",
            "  test_suite.py::test_pure",
        ]
    )
    # Deselected, they are still known not to opt in.
    pytester.runpytest(CPU, "--vram-prune-baselines", "-k", "marked").assert_outcomes(passed=1)
    assert set(stored(pytester)) == {"test_suite.py::test_marked", "test_suite.py::test_fixture"}


def test_the_table_shows_what_needs_a_look_then_the_largest_others(
    pytester: pytest.Pytester,
) -> None:
    sizes = list(range(1, 41))
    random.Random(4).shuffle(sizes)
    plain = "\n".join(f"def test_plain_{n}():\n    x = torch.ones({n * 1024})\n" for n in sizes)
    pytester.makepyfile(
        test_many="import torch\n" + plain + "\ndef test_new(vram):\n    x = torch.ones(8)\n"
    )
    result = pytester.runpytest(CPU, "--vram-report", "--vram-json=all.json")
    result.assert_outcomes(passed=41)
    lines = result.stdout.lines
    start = next(i for i, line in enumerate(lines) if line.startswith("test "))
    rows = lines[start + 1 : start + 2 + QUIET_ROWS]
    assert rows[0].startswith("test_many.py::test_new ")
    shown = [int(row.split()[0].rsplit("_", 1)[1]) for row in rows[1:]]
    assert shown == list(range(40, 40 - QUIET_ROWS, -1))
    assert lines[start + 2 + QUIET_ROWS] == (
        f"... and {40 - QUIET_ROWS} more tests that passed, did not opt in or skipped, smaller "
        "than those above; all are in --vram-json all.json"
    )
    result.stdout.fnmatch_lines(["41 measured tests: 1 new, 40 ungated"])


def test_a_test_that_did_not_opt_in_keeps_its_random_state(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_seed="""
        import torch

        torch.manual_seed(123)  # at collection, before any test's setup

        def test_plain():
            with open("draws.txt", "a") as out:
                out.write(f"{torch.rand(1).item()}\\n")
        """
    )
    draws = pytester.path / "draws.txt"
    for args in (
        ["-p", "no:vram"],
        [CPU, "--vram-report"],
        [CPU, "--vram-report", "--vram-seed=0"],
    ):
        pytester.runpytest(*args).assert_outcomes(passed=1)
    plain, reported, seeded = draws.read_text().split()
    assert reported == plain
    assert seeded != plain


BACKSTOP = """
import torch
from pytest_vram import max_vram

# Plain, on a machine without a GPU, torch.cuda counts nothing; the simulated device counts.
def test_plain():
    x = torch.ones(1000)
    assert torch.cuda.memory_allocated() == 0

@max_vram("1GiB")
def test_marked():
    x = torch.ones(1000)
    assert torch.cuda.memory_allocated() == 0

def test_fixture(vram):
    x = torch.ones(1000)
    assert torch.cuda.memory_allocated() == 0
"""


def test_a_test_that_fails_only_on_the_simulated_device_keeps_its_plain_outcome(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_backstop=BACKSTOP)
    result = pytester.runpytest(SIM, "--vram-report", "--vram-gate=all", "-p", "no:cacheprovider")
    # Simulated only because of --vram-gate=all: plain pytest's outcome, and the reason.
    # Opted in: it fails, saying it passes without the simulated device. With the vram
    # fixture it cannot run without the plugin: its failure stands as it is.
    result.assert_outcomes(passed=1, failed=2)
    result.stdout.fnmatch_lines(
        [
            "fails on the simulated device and passes without it (pytest -p no:vram): "
            "AssertionError: assert 4096 == 0",
            "pytest-vram: test_backstop.py::test_plain: its memory was not simulated: it fails "
            "on the simulated device (AssertionError: assert 4096 == 0) and passes without it",
        ]
    )
    result.stdout.fnmatch_lines(["FAILED test_backstop.py::test_fixture - AssertionError*"])
    result.stdout.fnmatch_lines(["1 test not measured: they fail on the simulated device*"])


CUDA_CHECKS = """
import pytest
import torch
from torch import nn

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

def test_where_the_tensors_are():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Linear(256, 256).to(device)
    x = torch.ones(64, 256, device=device)
    assert model(x).device.type == device
    assert next(model.parameters()).device.type == device
    assert x.is_cuda == (device == "cuda")

def test_skips_itself():
    if torch.cuda.device_count() < 1:
        pytest.skip("needs a GPU")

@needs_cuda
def test_cuda_only():
    assert torch.ones(2, device="cuda").is_cuda

def test_accelerator():
    found = torch.accelerator.current_accelerator()
    assert (found is not None) == torch.cuda.is_available()
"""


def test_a_test_simulated_only_because_every_test_is_gated_sees_the_machines_cuda(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_cuda_checks=CUDA_CHECKS)
    pytester.runpytest("-p", "no:vram").assert_outcomes(passed=2, skipped=2)
    data_file = pytester.path / "r.json"
    result = pytester.runpytest(SIM, "--vram-report", "--vram-gate=all", f"--vram-json={data_file}")
    # The branches plain pytest runs, measured on the simulated device all the same.
    result.assert_outcomes(passed=2, skipped=2)
    assert "its memory was not simulated" not in result.stdout.str()
    tests = {test["nodeid"]: test for test in json.loads(data_file.read_text())["tests"]}
    measured = tests["test_cuda_checks.py::test_where_the_tensors_are"]
    assert measured["peak_allocated"] >= 256 * 256 * 4 + 64 * 256 * 4
