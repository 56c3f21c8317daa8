"""Outputs that cannot be written: a usage error before the tests run where that can be known,
else at the end an error line per output, the other outputs written, and a failing exit status
without a traceback."""

from __future__ import annotations

import json
import os
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.baselines.store import BaselineStore
from pytest_vram.baselines.writer import BaselineWriter
from pytest_vram.options import Settings
from pytest_vram.record.record import TestRecord
from pytest_vram.report.outputs import write_outputs
from pytest_vram.units import parse_tolerance
from pytest_vram.wiring.preflight import preflight_problems
from pytest_vram.written import Written

CPU = "--vram-backend=cpu"
TESTS = "import torch\n\ndef test_a(vram):\n    x = torch.ones(1024)\n"


def settings(**kwargs: Any) -> Settings:
    fields: dict[str, Any] = {
        "report": False,
        "backend": "cpu",
        "cpu_counter": "auto",
        "sim_capacity": None,
        "baseline_dir": Path("baselines"),
        "tolerance": parse_tolerance("5%"),
        "update_baselines": False,
        "prune_baselines": False,
        "strict": False,
        "json_path": None,
        "markdown_path": None,
        "html_path": None,
        "junit_properties": True,
        "snapshot_dir": None,
    }
    fields.update(kwargs)
    return Settings(**fields)


def _cannot_write(directory: Path) -> bool:
    try:
        fd, probe = tempfile.mkstemp(dir=directory)
    except OSError:
        return True
    os.close(fd)
    os.unlink(probe)
    return False


@pytest.fixture
def unwritable(tmp_path: Path) -> Path:
    """A directory this process cannot create files in: a read-only one, or for root (whom
    permissions do not stop) /sys, where even root cannot."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    if _cannot_write(directory):
        yield directory
    elif Path("/sys").is_dir() and _cannot_write(Path("/sys")):
        yield Path("/sys")
    else:
        pytest.skip("no directory here that this user cannot write")
    directory.chmod(0o755)


def junit_cases(path: Path) -> list[str]:
    return [case.get("name") for case in ET.parse(path).getroot().iter("testcase")]


# -- preflight ---------------------------------------------------------------------------


def test_preflight_finds_nothing_wrong_with_writable_places(tmp_path: Path) -> None:
    ok = settings(
        update_baselines=True,
        baseline_dir=tmp_path / "new" / "baselines",
        json_path=tmp_path / "out" / "r.json",
        markdown_path=tmp_path / "r.md",
        html_path=tmp_path / "r.html",
        report=True,
    )
    (tmp_path / "summary.md").write_text("# earlier\n")
    assert preflight_problems(ok, {"GITHUB_STEP_SUMMARY": str(tmp_path / "summary.md")}) == []
    # The check leaves nothing behind, and creates nothing.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.md"]
    assert (tmp_path / "summary.md").read_text() == "# earlier\n"


def test_preflight_checks_the_baseline_dir_only_for_an_update_or_prune(tmp_path: Path) -> None:
    a_file = tmp_path / "baselines"
    a_file.write_text("")
    assert preflight_problems(settings(baseline_dir=a_file), {}) == []
    for option in ("update_baselines", "prune_baselines"):
        (problem,) = preflight_problems(settings(baseline_dir=a_file, **{option: True}), {})
        assert f"cannot write baselines in {a_file}: it is a file, not a directory" in problem
        assert option.replace("_", "-") in problem


def test_preflight_names_each_bad_output(tmp_path: Path) -> None:
    (tmp_path / "a-dir").mkdir()
    (tmp_path / "a-file").write_text("")
    problems = preflight_problems(
        settings(
            json_path=tmp_path / "a-dir",
            markdown_path=tmp_path / "a-file" / "r.md",
            html_path=tmp_path / "a-file" / "deeper" / "r.html",
            report=True,
        ),
        {"GITHUB_STEP_SUMMARY": str(tmp_path / "a-dir")},
    )
    assert problems == [
        f"--vram-json {tmp_path / 'a-dir'}: cannot write the report there: it is a directory",
        f"--vram-markdown {tmp_path / 'a-file' / 'r.md'}: cannot write the report there: "
        f"{tmp_path / 'a-file'} is a file, not a directory",
        f"--vram-html {tmp_path / 'a-file' / 'deeper' / 'r.html'}: cannot write the report "
        f"there: {tmp_path / 'a-file'} is a file, not a directory",
        f"$GITHUB_STEP_SUMMARY {tmp_path / 'a-dir'}: cannot append the memory table: "
        "it is a directory",
    ]


def test_preflight_ignores_the_step_summary_unless_a_table_is_asked_for(tmp_path: Path) -> None:
    assert preflight_problems(settings(), {"GITHUB_STEP_SUMMARY": str(tmp_path)}) == []


def test_preflight_names_an_unwritable_directory(unwritable: Path) -> None:
    problems = preflight_problems(
        settings(
            update_baselines=True,
            baseline_dir=unwritable / "baselines",
            html_path=unwritable / "r.html",
        ),
        {},
    )
    assert len(problems) == 2
    assert all("Permission denied" in problem for problem in problems)
    assert str(unwritable / "baselines") in problems[0]


def test_an_unwritable_baseline_dir_stops_an_update_before_the_tests(
    pytester: pytest.Pytester, unwritable: Path
) -> None:
    pytester.makepyfile(TESTS)
    result = pytester.runpytest(
        CPU, "--vram-update-baselines", f"--vram-baseline-dir={unwritable / 'baselines'}"
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [f"ERROR: --vram-update-baselines: cannot write baselines in {unwritable}*Permission*"]
    )
    assert "Traceback" not in result.stdout.str() + result.stderr.str()


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--vram-update-baselines", "--vram-baseline-dir=a-file"], "it is a file"),
        (["--vram-prune-baselines", "--vram-baseline-dir=a-file/deeper"], "a-file is a file"),
        (["--vram-json=a-dir"], "--vram-json a-dir: cannot write the report there"),
        (["--vram-markdown=a-file/r.md"], "--vram-markdown a-file/r.md"),
        (["--vram-html=a-dir"], "--vram-html a-dir: cannot write the report there"),
    ],
)
def test_unwritable_outputs_are_usage_errors_before_any_test_runs(
    pytester: pytest.Pytester, args: list[str], words: str
) -> None:
    pytester.makepyfile(TESTS + "\nopen('ran', 'w').close()\n")
    (pytester.path / "a-dir").mkdir()
    (pytester.path / "a-file").write_text("")
    result = pytester.runpytest(CPU, *args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert words in result.stderr.str()
    assert not (pytester.path / "ran").exists()


def test_an_unwritable_step_summary_is_a_usage_error(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(TESTS)
    (pytester.path / "summary").mkdir()
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(pytester.path / "summary"))
    result = pytester.runpytest(CPU, "--vram-report")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*$GITHUB_STEP_SUMMARY *summary: cannot append*directory*"])
    # Without a table to append it is not looked at.
    pytester.runpytest(CPU).assert_outcomes(passed=1)


# -- at the end of the run -----------------------------------------------------------------

# The test breaks the place an output goes after the preflight check passed.
BREAKS = """
import shutil
from pathlib import Path
import torch

def test_a(vram):
    x = torch.ones(1024)

def test_breaks_{what}(vram):
    path = Path("{path}")
    if path.is_dir():
        shutil.rmtree(path)
    path.write_text("now a file")
"""


def test_a_baseline_dir_gone_bad_fails_the_run_and_the_other_outputs_are_written(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(BREAKS.format(what="baselines", path="baselines"))
    result = pytester.runpytest(
        CPU,
        "--vram-update-baselines",
        "--junitxml=junit.xml",
        "--vram-json=out/report.json",
        "--vram-markdown=report.md",
    )
    result.assert_outcomes(passed=2)
    assert result.ret == pytest.ExitCode.INTERNAL_ERROR
    result.stdout.fnmatch_lines(
        [
            "pytest-vram: wrote out/report.json",
            "pytest-vram: wrote report.md",
            "pytest-vram: error: cannot write the baselines baselines/cpu.yaml: Not a directory*",
        ]
    )
    output = result.stdout.str() + result.stderr.str()
    assert "Traceback" not in output
    assert "INTERNALERROR" not in output
    assert junit_cases(pytester.path / "junit.xml") == ["test_a", "test_breaks_baselines"]
    assert json.loads((pytester.path / "out" / "report.json").read_text())["tests"]
    assert "test_a" in (pytester.path / "report.md").read_text()
    assert (pytester.path / "baselines").read_text() == "now a file"


def test_a_report_path_gone_bad_fails_the_run_and_the_other_outputs_are_written(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(BREAKS.format(what="out", path="out"))
    summary = pytester.path / "summary.md"
    summary.write_text("")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    result = pytester.runpytest(
        CPU,
        "--vram-update-baselines",
        "--junitxml=junit.xml",
        "--vram-json=out/report.json",
        "--vram-markdown=report.md",
        "--vram-html=report.html",
    )
    assert result.ret == pytest.ExitCode.INTERNAL_ERROR
    result.stdout.fnmatch_lines(
        [
            "pytest-vram: baselines: 2 added, 0 updated, 0 removed in baselines/cpu.yaml*",
            "pytest-vram: wrote report.md",
            "pytest-vram: wrote report.html",
            "pytest-vram: error: cannot write --vram-json out/report.json: *",
        ]
    )
    assert "Traceback" not in result.stdout.str() + result.stderr.str()
    assert junit_cases(pytester.path / "junit.xml") == ["test_a", "test_breaks_out"]
    assert "test_a" in summary.read_text()
    assert (pytester.path / "report.html").read_text().startswith("<!")


def test_a_failed_run_keeps_its_exit_status(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        BREAKS.format(what="baselines", path="baselines") + "\ndef test_no():\n    assert False\n"
    )
    result = pytester.runpytest(CPU, "--vram-update-baselines")
    result.assert_outcomes(passed=2, failed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["pytest-vram: error: cannot write the baselines*"])


def test_write_outputs_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "a-file").write_text("")
    import pytest_vram.report.html

    def broken(document: dict[str, Any]) -> str:
        raise ValueError("no chart for this")

    monkeypatch.setattr(pytest_vram.report.html, "render_html", broken)
    written = write_outputs(
        lambda: {"tests": []},
        settings(
            json_path=tmp_path / "a-file" / "r.json",
            markdown_path=tmp_path / "r.md",
            html_path=tmp_path / "r.html",
        ),
        str(tmp_path),  # a directory: appending to it fails
    )
    assert written.lines == [f"wrote {tmp_path / 'r.md'}"]
    assert written.errors == [
        f"cannot write --vram-json {tmp_path / 'a-file' / 'r.json'}: Not a directory "
        f"({tmp_path / 'a-file'})",
        f"cannot append to $GITHUB_STEP_SUMMARY {tmp_path}: Is a directory ({tmp_path})",
        f"cannot write --vram-html {tmp_path / 'r.html'}: ValueError: no chart for this",
    ]
    assert written.notes()[-1].startswith("error: cannot write --vram-html")


def test_write_outputs_survives_a_document_that_cannot_be_built(tmp_path: Path) -> None:
    def build() -> dict[str, Any]:
        raise KeyError("backend")

    written = write_outputs(build, settings(json_path=tmp_path / "r.json"), None)
    assert written == Written([], ["cannot build the memory report: KeyError: 'backend'"])
    assert not (tmp_path / "r.json").exists()


def test_save_reports_each_file_and_writes_the_others(tmp_path: Path) -> None:
    store = BaselineStore.load(tmp_path)
    writer = BaselineWriter(store, {"cpu": {"torch": "2.13.0"}})
    writer.update(
        [
            TestRecord(nodeid="t.py::a", backend="cpu", device="cpu", peak_allocated=1),
            TestRecord(nodeid="t.py::a", backend="cpu", device="sim", peak_allocated=2),
        ]
    )
    (tmp_path / "cpu.yaml").mkdir()  # in the way of the cpu file's rename
    written = writer.save()
    assert len(written.errors) == 1
    assert written.errors[0].startswith(f"{tmp_path / 'cpu.yaml'}: cannot read")
    assert "Is a directory" in written.errors[0]
    assert written.errors[0].endswith("this run's changes to it were not written")
    assert written.lines == [
        f"baselines: 1 added, 0 updated, 0 removed in {tmp_path / 'sim.yaml'} (1 entry)"
    ]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        pytest.param(
            ["--vram-json=baselines/cpu.yaml"],
            "--vram-json baselines/cpu.yaml is in the baseline directory *: it would overwrite "
            "or mix with the stored baselines; write it elsewhere",
            id="json-on-a-baseline-file",
        ),
        pytest.param(
            ["--vram-html=baselines/report.html"],
            "--vram-html baselines/report.html is in the baseline directory *",
            id="html-in-the-baseline-dir",
        ),
        pytest.param(
            ["--vram-snapshot-on-fail=baselines"],
            "--vram-snapshot-on-fail baselines is in the baseline directory *",
            id="snapshots-in-the-baseline-dir",
        ),
        pytest.param(
            ["--vram-json=out.txt", "--vram-markdown=./out.txt"],
            "--vram-json and --vram-markdown both name out.txt: each output needs its own path",
            id="json-and-markdown",
        ),
        pytest.param(
            ["--vram-markdown=out.txt", "--junitxml=out.txt"],
            "--vram-markdown and --junitxml both name out.txt: each output needs its own path",
            id="markdown-and-junit",
        ),
        pytest.param(
            ["--junitxml=baselines/cpu.yaml"],
            "--junitxml baselines/cpu.yaml is in the baseline directory *",
            id="junit-alone",
        ),
    ],
)
def test_an_output_on_an_input_or_another_output_is_refused_before_any_test(
    pytester: pytest.Pytester, args: list[str], message: str
) -> None:
    pytester.makepyfile(test_a="def test_a(vram):\n    open('ran', 'w').close()\n")
    pytester.runpytest(CPU, "--vram-update-baselines").assert_outcomes(passed=1)
    stored = (pytester.path / "baselines" / "cpu.yaml").read_bytes()
    (pytester.path / "ran").unlink()

    result = pytester.runpytest(CPU, "--vram-report", *args)

    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: {message}"])
    assert not (pytester.path / "ran").exists()
    assert (pytester.path / "baselines" / "cpu.yaml").read_bytes() == stored


def test_a_prune_under_xdist_is_refused_before_any_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_a="def test_a(vram):\n    open('ran', 'w').close()\n")
    result = pytester.runpytest(CPU, "-n", "2", "--vram-update-baselines", "--vram-prune-baselines")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "ERROR: --vram-prune-baselines needs the whole collection, which the pytest-xdist "
            "controller does not see: run the prune without -n (-p no:xdist)"
        ]
    )
    assert not (pytester.path / "ran").exists()
