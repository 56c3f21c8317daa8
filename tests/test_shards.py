"""`pytest-vram update-baselines SHARD.json...`: a sharded run stores what one run would."""

from __future__ import annotations

import copy
import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.cli import main

CPU = "--vram-backend=cpu"

SUITE = """
import pytest
import torch

from pytest_vram import max_vram


def test_alpha(vram):
    x = torch.ones(4096)

def test_beta_unmarked():
    x = torch.ones(1024)

def test_gamma_idle(vram):
    x = torch.ones(2048)
    vram.empty_cache()

def test_delta_step(vram):
    vram.single_step(lambda: torch.ones(8192).sum())

def test_epsilon_leak_check(vram):
    vram.leak_check(lambda: torch.ones(64).sum(), steps=5)

@max_vram("1KiB")
def test_zeta_over_budget():
    x = torch.ones(4096)

def test_eta_fails(vram):
    x = torch.ones(4096)
    assert False

@pytest.mark.skip(reason="not here")
def test_theta_skipped(vram):
    pass

@pytest.mark.parametrize("n", [16, 32, 64])
def test_iota(n):
    x = torch.ones(n, n)
"""

# Every test of SUITE in exactly one shard.
SHARDS = ("alpha or beta or gamma", "delta or epsilon or zeta", "fails or theta or iota")


def baseline_files(directory: Path) -> dict[str, str]:
    return {path.name: path.read_text() for path in sorted(directory.glob("*.yaml"))}


def seed_baselines(directory: Path) -> None:
    """A committed baseline with an entry of a test that exists but runs in no shard."""
    directory.mkdir()
    (directory / "cpu.yaml").write_text(
        "device: cpu\ntests:\n  test_other.py::test_kept:\n    peak_allocated: 123\n"
        "  test_suite.py::test_alpha:\n    peak_allocated: 1\n"
    )


@pytest.fixture
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makepyfile(test_suite=SUITE, test_other="def test_kept():\n    pass\n")
    return pytester


def unsharded(pytester: pytest.Pytester, *args: str) -> dict[str, str]:
    seed_baselines(pytester.path / "one")
    pytester.runpytest(
        CPU, "test_suite.py", "--vram-update-baselines", "--vram-baseline-dir=one", *args
    )
    return baseline_files(pytester.path / "one")


def shard_documents(
    pytester: pytest.Pytester, *args: str, mode: str = "--vram-report"
) -> list[str]:
    """Run SHARDS against the committed baselines in ``merged``; the paths of their JSON.

    ``--vram-report`` compares (a pull request's jobs); ``--vram-update-baselines`` stores,
    each shard in a checkout of its own, as on separate hosts.
    """
    seed_baselines(pytester.path / "merged")
    paths = []
    for index, expression in enumerate(SHARDS):
        path = f"shard{index}.json"
        directory = "merged"
        if mode == "--vram-update-baselines":
            directory = f"checkout{index}"
            shutil.copytree(pytester.path / "merged", pytester.path / directory)
        pytester.runpytest(
            CPU,
            "test_suite.py",
            "-k",
            expression,
            mode,
            f"--vram-baseline-dir={directory}",
            f"--vram-json={path}",
            *args,
        )
        paths.append(path)
    return paths


@pytest.mark.parametrize("mode", ["--vram-report", "--vram-update-baselines", "-q"])
def test_merged_shards_store_what_one_unsharded_run_stores(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    expected = unsharded(suite)
    shards = shard_documents(suite, mode=mode)
    capsys.readouterr()

    assert main(["update-baselines", *shards, "--baseline-dir", "merged"]) == 0

    assert baseline_files(suite.path / "merged") == expected
    stored = expected["cpu.yaml"]
    # Failed memory checks, failed and skipped tests are not stored, nor the tests that did
    # not opt in; the others are, with their scenario figures, and the entry of the test that
    # ran nowhere is kept.
    for absent in ("zeta_over_budget", "eta_fails", "theta_skipped", "beta_unmarked", "iota"):
        assert absent not in stored
    for present in ("test_gamma_idle", "idle:", "single_step_peak:"):
        assert present in stored
    assert "leak_growth: 0" in stored
    assert "test_other.py::test_kept:\n    peak_allocated: 123" in stored
    assert "environment:\n  backend: cpu" in stored
    assert capsys.readouterr().out.startswith("baselines: 3 added, 1 updated, 0 removed in merged")


# Three xdist runs, two workers each: test_prune_names_a_shard_that_cannot_tell_what_is_stale
# runs xdist by default, and test_merged_shards_store_what_one_unsharded_run_stores the merge.
@pytest.mark.slow
def test_xdist_shards_merge_like_one_run(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("xdist")
    expected = unsharded(suite)
    shards = shard_documents(suite, "-n", "2")

    assert main(["update-baselines", *shards, "--baseline-dir", "merged"]) == 0
    assert baseline_files(suite.path / "merged") == expected


def test_merging_again_changes_nothing(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = shard_documents(suite)
    shutil.rmtree(suite.path / "merged")
    assert main(["update-baselines", *shards, "--baseline-dir", "merged"]) == 0
    before = baseline_files(suite.path / "merged")
    capsys.readouterr()
    # The same shard given twice, and a second merge: the files stay byte for byte.
    assert main(["update-baselines", *shards, shards[0], "--baseline-dir", "merged"]) == 0
    assert baseline_files(suite.path / "merged") == before
    assert "no change" in capsys.readouterr().out


def test_prune_removes_what_an_unsharded_prune_removes(suite: pytest.Pytester) -> None:
    (suite.path / "test_other.py").unlink()  # test_kept's file is gone: its entry is stale
    expected = unsharded(suite, "--vram-prune-baselines")
    assert "test_kept" not in expected["cpu.yaml"]
    shards = shard_documents(suite)

    assert main(["update-baselines", *shards, "--baseline-dir", "merged", "--prune"]) == 0
    assert baseline_files(suite.path / "merged") == expected


def test_a_shard_that_gated_every_test_and_measured_only_marked_ones_is_refused(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    suite.runpytest(CPU, "test_suite.py", "--vram-gate=all", "--vram-json=marked.json")

    assert main(["update-baselines", "marked.json", "--baseline-dir", "merged"]) == 2
    error = capsys.readouterr().err
    assert "marked.json: that run gated every test (--vram-gate=all) but measured only" in error
    assert "--vram-report" in error
    assert not (suite.path / "merged").exists()


def test_a_test_measured_differently_in_two_shards_is_refused(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    suite.runpytest(CPU, "test_suite.py", "-k", "alpha", "--vram-report", "--vram-json=a.json")
    document = json.loads((suite.path / "a.json").read_text())
    document["tests"][0]["peak_allocated"] += 512
    (suite.path / "b.json").write_text(json.dumps(document))

    assert main(["update-baselines", "a.json", "b.json", "--baseline-dir", "merged"]) == 2
    error = capsys.readouterr().err
    assert "test_suite.py::test_alpha ran on cpu in both a.json and b.json" in error


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        ("{not json", "not a JSON file"),
        ('{"tests": 3}', "not a pytest-vram --vram-json document"),
        ('{"tests": [{"nodeid": "t"}]}', "test 0 is not a pytest-vram record"),
        pytest.param(
            '{"tests": [{"nodeid": "t", "peak_allocated": %s}]}' % ("9" * 5000),
            "a number in it has more digits than Python reads; a figure has at most 19",
            id="5000-digits",
        ),
    ],
)
def test_a_file_that_is_no_shard_document_is_an_input_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, problem: str
) -> None:
    shard = tmp_path / "shard.json"
    shard.write_text(content)

    assert main(["update-baselines", str(shard), "--baseline-dir", str(tmp_path / "b")]) == 2
    assert f"pytest-vram: error: {shard}: {problem}" in capsys.readouterr().err


def test_a_missing_shard_is_an_input_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["update-baselines", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: cannot read it: No such file or directory" in capsys.readouterr().err


def test_a_malformed_baseline_directory_is_an_input_error(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    shards = shard_documents(suite)[:1]
    (suite.path / "merged" / "cpu.yaml").write_text("device: cpu\ntests: [1\n")

    assert main(["update-baselines", *shards, "--baseline-dir", "merged"]) == 2
    assert "merged/cpu.yaml:2: malformed baseline file" in capsys.readouterr().err


def test_an_environment_with_empty_fields_is_not_rewritten(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    # The sim environment has sim_capacity None, which a baseline file leaves out.
    pytester.makepyfile(test_sim_environment="def test_one(vram):\n    pass\n")
    first = pytester.runpytest("--vram-backend=sim", "--vram-update-baselines")
    first.stdout.fnmatch_lines(["*baselines: 1 added*"])
    again = pytester.runpytest("--vram-backend=sim", "--vram-update-baselines")
    again.stdout.fnmatch_lines(["pytest-vram: baselines: no change in baselines (*)"])
    assert "added" not in again.stdout.str()

    pytester.runpytest("--vram-backend=sim", "--vram-report", "--vram-json=shard.json")
    capsys.readouterr()
    assert main(["update-baselines", "shard.json"]) == 0
    assert capsys.readouterr().out == "baselines: no change in baselines\n"


def test_prune_names_a_shard_that_cannot_tell_what_is_stale(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("xdist")
    suite.runpytest(CPU, "test_suite.py", "-n", "2", "--vram-report", "--vram-json=x.json")
    capsys.readouterr()

    assert main(["update-baselines", "x.json", "--prune"]) == 0
    assert "note: --prune: x.json cannot tell which tests no longer exist" in (
        capsys.readouterr().out
    )


# -- figures read back ---------------------------------------------------------------------------

# Every figure a baseline stores on the simulated device: peak reserved, the three scenarios
# and, with --vram-breakdown, the category totals; and a leak check whose memory falls.
FIGURES_SUITE = """
import torch


def test_model(vram):
    model = torch.nn.Linear(64, 64)
    x = torch.ones(8, 64)
    vram.empty_cache()
    vram.single_step(lambda: model(x).sum().backward())
    vram.leak_check(lambda: model(x).sum(), steps=3)


def test_shrinks(vram):
    held = [torch.ones(1024) for _ in range(20)]
    vram.leak_check(lambda: held.pop(), steps=5)
"""
MODEL = "test_figures_suite.py::test_model"
COMMITTED = "device: sim\ntests:\n  test_other.py::test_kept:\n    peak_allocated: 123\n"


@pytest.fixture(scope="module")
def measured(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The --vram-json document of a real run of FIGURES_SUITE, made once for the module."""
    directory = tmp_path_factory.mktemp("measured")
    (directory / "test_figures_suite.py").write_text(FIGURES_SUITE)
    subprocess.run(
        [
            *(sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "--vram-backend=sim"),
            *("--vram-breakdown", "--vram-report", "--vram-json=shard.json"),
            "test_figures_suite.py",
        ],
        cwd=directory,
        check=True,
        capture_output=True,
    )
    return json.loads((directory / "shard.json").read_text())


def rank(number: object, **figures: object) -> dict[str, Any]:
    """One rank's entry in a torchrun record's ``ranks``."""
    return {"rank": number, "status": "new", "outcome": "passed", "leftover": 0, "figures": figures}


# A field of a shard's test record (as a path into it), a bad value, and the error's words.
BAD_VALUES: list[tuple[tuple[str, ...], object, str]] = [
    (("peak_allocated",), -5, "peak_allocated is -5: a number of bytes is never negative"),
    (("peak_allocated",), 1.5, "peak_allocated must be an integer number of bytes, got 1.5"),
    (("peak_allocated",), True, "peak_allocated must be an integer number of bytes, got True"),
    (
        ("peak_allocated",),
        "4096",
        "peak_allocated must be an integer number of bytes, got '4096'",
    ),
    (
        ("peak_allocated",),
        float("nan"),
        "peak_allocated is nan: a number of bytes is a whole number",
    ),
    (
        ("peak_allocated",),
        10**400,
        "peak_allocated has 401 digits: more bytes than any device holds "
        "(at most 9223372036854775807)",
    ),
    (("peak_reserved",), -1, "peak_reserved is -1: a number of bytes is never negative"),
    (("peak_device",), "1GiB", "peak_device must be an integer number of bytes, got '1GiB'"),
    (
        ("scenarios", "leak_check", "growth"),
        "lots",
        "scenarios.leak_check.growth must be an integer number of bytes, got 'lots'",
    ),
    (
        ("scenarios", "single_step", "peak"),
        2.5,
        "scenarios.single_step.peak must be an integer number of bytes, got 2.5",
    ),
    (
        ("scenarios", "empty_cache", "allocated"),
        None,
        "scenarios.empty_cache.allocated must be an integer number of bytes, got None",
    ),
    (
        ("breakdown", "categories", "parameters"),
        -16896,
        "breakdown.categories.parameters is -16896: a number of bytes is never negative",
    ),
    (
        ("ranks",),
        [rank(0, peak_allocated=100), rank(1, peak_allocated="lots")],
        "ranks[1].figures.peak_allocated must be an integer number of bytes, got 'lots'",
    ),
    (
        ("ranks",),
        [rank(-1, peak_allocated=100)],
        "ranks[0].rank must be a rank from 0 to 999999, got -1",
    ),
    (("nodeid",), 5, "a test node id must be text, got 5"),
    (("backend",), 7, "backend must be text, got 7"),
    (("device",), 7, "device must be text, got 7"),
]


@pytest.mark.parametrize(
    ("field", "value", "problem"),
    [pytest.param(*case, id=f"{'.'.join(case[0])}={case[1]!r}"[:40]) for case in BAD_VALUES],
)
def test_a_bad_value_in_a_shard_is_an_error_naming_file_test_and_value(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    measured: dict[str, Any],
    field: tuple[str, ...],
    value: object,
    problem: str,
) -> None:
    document = copy.deepcopy(measured)
    index = next(i for i, test in enumerate(document["tests"]) if test["nodeid"] == MODEL)
    target = document["tests"][index]
    for key in field[:-1]:
        target = target[key]
    target[field[-1]] = value
    shard = tmp_path / "shard.json"
    shard.write_text(json.dumps(document))
    committed = tmp_path / "baselines" / "sim.yaml"
    committed.parent.mkdir()
    committed.write_text(COMMITTED)

    code = main(["update-baselines", str(shard), "--baseline-dir", str(committed.parent)])

    test = f"test {index}" if field == ("nodeid",) else f"test {index} ({MODEL})"
    assert capsys.readouterr().err == f"pytest-vram: error: {shard}: {test}: {problem}\n"
    assert code == 2
    assert committed.read_text() == COMMITTED


def test_a_shard_whose_leak_check_memory_fell_merges_into_baselines_the_next_run_reads(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str], measured: dict[str, Any]
) -> None:
    pytester.makepyfile(test_figures_suite=FIGURES_SUITE)
    (pytester.path / "shard.json").write_text(json.dumps(measured))
    shrinks = next(t for t in measured["tests"] if t["nodeid"].endswith("test_shrinks"))
    assert shrinks["scenarios"]["leak_check"]["growth"] < 0

    assert main(["update-baselines", "shard.json"]) == 0
    stored = (pytester.path / "baselines" / "sim.yaml").read_text()
    assert "test_figures_suite.py::test_shrinks:\n    leak_growth: 0\n" in stored
    for name in (
        "idle",
        "single_step_peak",
        "peak_reserved",
        "peak_parameters",
        "peak_cublas_workspaces",
    ):
        assert f"    {name}: " in stored

    result = pytester.runpytest("--vram-backend=sim", "--vram-report")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str() + result.stderr.str()
    result.stdout.fnmatch_lines(["*2 measured tests: 2 ok*"])


@pytest.mark.parametrize(
    ("ini", "stored_in"),
    [
        ("[pytest]\nvram_baseline_dir = memory/baselines\n", "memory/baselines"),
        ("[pytest]\n", "baselines"),
    ],
    ids=["ini vram_baseline_dir", "no ini setting"],
)
def test_without_baseline_dir_the_merge_writes_where_pytest_would(
    suite: pytest.Pytester,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    ini: str,
    stored_in: str,
) -> None:
    suite.makeini(ini)
    suite.runpytest(CPU, "test_suite.py", "-k", "alpha", "--vram-report", "--vram-json=s.json")
    (suite.path / "tests").mkdir()
    # From a folder below the rootdir, as a CI step might run it.
    monkeypatch.chdir(suite.path / "tests")
    assert main(["update-baselines", "../s.json"]) == 0
    assert "test_suite.py::test_alpha:" in (suite.path / stored_in / "cpu.yaml").read_text()
    assert not (suite.path / "tests" / "baselines").exists()
    # The plugin, run from the rootdir, compares with what the merge stored.
    monkeypatch.chdir(suite.path)
    result = suite.runpytest(CPU, "test_suite.py", "-k", "alpha", "--vram-report", "--vram-strict")
    result.assert_outcomes(passed=1)
