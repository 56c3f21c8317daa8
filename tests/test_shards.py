"""`pytest-vram update-baselines SHARD.json...`: a sharded run stores what one run would."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

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


@pytest.mark.parametrize("mode", ["--vram-report", "--vram-update-baselines"])
def test_merged_shards_store_what_one_unsharded_run_stores(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    expected = unsharded(suite)
    shards = shard_documents(suite, mode=mode)
    capsys.readouterr()

    assert main(["update-baselines", *shards, "--baseline-dir", "merged"]) == 0

    assert baseline_files(suite.path / "merged") == expected
    stored = expected["cpu.yaml"]
    # Failed memory checks, failed and skipped tests are not stored; the others are, with
    # their scenario figures, and the entry of the test that ran nowhere is kept.
    for absent in ("zeta_over_budget", "eta_fails", "theta_skipped"):
        assert absent not in stored
    for present in ("test_beta_unmarked", "test_iota[64]", "idle:", "single_step_peak:"):
        assert present in stored
    assert "leak_growth: 0" in stored
    assert "test_other.py::test_kept:\n    peak_allocated: 123" in stored
    assert "environment:\n  backend: cpu" in stored
    assert capsys.readouterr().out.startswith("baselines: 7 added, 1 updated, 0 removed in merged")


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


def test_a_shard_that_measured_only_marked_tests_is_refused(
    suite: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    suite.runpytest(CPU, "test_suite.py", "--vram-json=marked.json")

    assert main(["update-baselines", "marked.json", "--baseline-dir", "merged"]) == 2
    error = capsys.readouterr().err
    assert "marked.json: that run measured only the tests with a vram marker" in error
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
    assert "baselines:" not in again.stdout.str()

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
