"""``pytest-vram compare --markdown``: the pull-request comment, from the reports of real runs."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_vram.cli import main
from pytest_vram.report.comparison import MARKER, render_comparison
from pytest_vram.report.runcomparison import compare_runs

ROOT = Path(__file__).resolve().parent.parent

# A table row's cell separators: pipes not escaped with a backslash.
CELL_SEPARATOR = re.compile(r"(?<!\\)\|")

# The same tests at a pull request's base and head. torch.ones(n) allocates 4 * n bytes on the
# cpu backend, so each peak is known; `test_same` does not change.
BASE = """
import pytest
import torch
from pytest_vram import max_vram

def test_grows(vram):
    x = torch.ones(1024)

def test_shrinks(vram):
    x = torch.ones(2048)

def test_grows_a_little(vram):
    x = torch.ones(100_000)

def test_same(vram):
    x = torch.ones(256)

@max_vram("8KiB")
def test_budget(vram):
    x = torch.ones(1024)

@pytest.mark.parametrize("name", ["a|b"])
def test_named(vram, name):
    x = torch.ones(512)

def test_removed(vram):
    x = torch.ones(64)
"""
HEAD = """
import pytest
import torch
from pytest_vram import max_vram

def test_grows(vram):
    x = torch.ones(4096)

def test_shrinks(vram):
    x = torch.ones(1024)

def test_grows_a_little(vram):
    x = torch.ones(101_000)

def test_same(vram):
    x = torch.ones(256)

@max_vram("8KiB")
def test_budget(vram):
    x = torch.ones(4096)

@pytest.mark.parametrize("name", ["a|b"])
def test_named(vram, name):
    x = torch.ones(1024)

def test_new(vram):
    x = torch.ones(128)
"""


def _measure(pytester: pytest.Pytester, source: str, side: str) -> None:
    """Run ``source`` as test_mem.py, writing ``SIDE.xml`` and ``SIDE.json``."""
    pytester.makepyfile(test_mem=source)
    pytester.runpytest(
        "--vram-backend=cpu",
        "--vram-report",
        f"--junitxml={side}.xml",
        f"--vram-json={side}.json",
    )
    assert (pytester.path / f"{side}.xml").is_file() and (pytester.path / f"{side}.json").is_file()


def _compare(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    capsys.readouterr()  # what the pytest runs printed
    status = main(["compare", *args, "--markdown"])
    out, err = capsys.readouterr()
    return status, out, err


def _rows(text: str, heading: str) -> list[list[str]]:
    """The cells of each row of the table under ``heading`` (the first table: ``""``)."""
    section = text.split(f"#### {heading}\n", 1)[1] if heading else text
    rows = []
    for line in section.split("\n|---", 1)[1].splitlines()[1:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip() for cell in CELL_SEPARATOR.split(line)[1:-1]])
    return rows


@pytest.mark.slow
def test_comment_from_junit_files(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    _measure(pytester, BASE, "base")
    _measure(pytester, HEAD, "head")
    status, out, err = _compare(capsys, "base.xml", "head.xml")
    # Three tests grew beyond 5%: the comparison fails, as without --markdown.
    assert (status, err) == (1, "")
    assert out.startswith(MARKER + "\n")
    assert "**3 tests grew beyond the tolerance (5%).**" in out
    # Biggest change first (of two alike, by name); the unchanged test is not listed.
    grown = "**grown beyond 5%**"
    assert _rows(out, "") == [
        ["`test_mem::test_budget`", "4.00 KiB", "16.00 KiB", "+12.00 KiB (+300.0%)", grown],
        ["`test_mem::test_grows`", "4.00 KiB", "16.00 KiB", "+12.00 KiB (+300.0%)", grown],
        ["`test_mem::test_shrinks`", "8.00 KiB", "4.00 KiB", "-4.00 KiB (-50.0%)", "shrunk"],
        [
            "`test_mem::test_grows_a_little`",
            "390.62 KiB",
            "394.53 KiB",
            "+3.91 KiB (+1.0%)",
            "grown within the tolerance",
        ],
        # The pipe in the test's name is escaped: the row keeps its five cells.
        [r"`test_mem::test_named[a\|b]`", "2.00 KiB", "4.00 KiB", "+2.00 KiB (+100.0%)", grown],
    ]
    assert "test_same" not in out
    # A JUnit file does not carry the budget itself.
    assert _rows(out, "Budgets crossed") == [
        ["`test_mem::test_budget`", "4.00 KiB", "16.00 KiB", "—"]
    ]
    assert _rows(out, "New tests") == [["`test_mem::test_new`", "512 B", "new"]]
    assert _rows(out, "Removed tests") == [["`test_mem::test_removed`", "256 B"]]


@pytest.mark.slow
def test_comment_from_json_reports_and_from_both_kinds(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    _measure(pytester, BASE, "base")
    _measure(pytester, HEAD, "head")
    status, out, _ = _compare(capsys, "base.json", "head.json")
    assert status == 1
    # Named by node id, and the budget is known.
    assert _rows(out, "Budgets crossed") == [
        ["`test_mem.py::test_budget`", "4.00 KiB", "16.00 KiB", "8.00 KiB"]
    ]
    assert [row[0] for row in _rows(out, "New tests")] == ["`test_mem.py::test_new`"]
    # A JUnit base and a JSON head: the same tests match, whatever spelling each file uses.
    status, mixed, _ = _compare(capsys, "base.xml", "head.json")
    assert status == 1
    assert [row[0] for row in _rows(mixed, "")] == [
        row[0].replace("test_mem.py::", "test_mem::") for row in _rows(out, "")
    ]
    assert [row[0] for row in _rows(mixed, "New tests")] == ["`test_mem::test_new`"]
    assert [row[0] for row in _rows(mixed, "Removed tests")] == ["`test_mem::test_removed`"]


@pytest.mark.slow
def test_nothing_changed_prints_nothing(pytester: pytest.Pytester) -> None:
    """As the workflow runs it: the installed command, a file for the comment, the status."""
    _measure(pytester, BASE, "base")
    _measure(pytester, BASE, "head")
    command = shutil.which("pytest-vram", path=str(Path(sys.executable).parent))
    assert command is not None
    for base, head in (("base.json", "head.json"), ("base.xml", "head.xml")):
        result = subprocess.run(
            [command, "compare", base, head, "--markdown"],
            cwd=pytester.path,
            capture_output=True,
            text=True,
            check=False,
        )
        assert (result.returncode, result.stdout, result.stderr) == (0, "", "")
    # Without --markdown the command still says what it compared.
    plain = subprocess.run(
        [command, "compare", "base.json", "head.json"],
        cwd=pytester.path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert plain.returncode == 0 and "7 unchanged." in plain.stdout


@pytest.mark.slow
def test_a_bad_value_in_a_json_report(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    _measure(pytester, BASE, "base")
    document = json.loads((pytester.path / "base.json").read_text())
    index = next(i for i, t in enumerate(document["tests"]) if t["nodeid"].endswith("test_grows"))
    document["tests"][index]["peak_allocated"] = "lots"
    (pytester.path / "head.json").write_text(json.dumps(document))
    status, out, err = _compare(capsys, "base.json", "head.json")
    assert (status, out) == (2, "")
    # One line: the file, the test and the value, no traceback.
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("pytest-vram: error: head.json: ")
    assert f"test {index} (test_mem.py::test_grows)" in err and "'lots'" in err


# --- rendering, without pytest runs -------------------------------------------------------------


def _row(name: str, peak: int, status: str = "ok") -> dict[str, object]:
    return {"name": name, "vram_peak_allocated": peak, "vram_status": status, "vram_device": "sim"}


def test_unchanged_runs_render_nothing() -> None:
    rows = [_row("t::a", 100), _row("t::b", 200)]
    assert render_comparison(compare_runs(rows, rows), rows, rows) == ""


def test_a_budget_crossed_without_a_change_in_peak_is_a_change() -> None:
    base, head = [_row("t::a", 100)], [_row("t::a", 100, "over-budget")]
    text = render_comparison(compare_runs(base, head), base, head)
    assert _rows(text, "Budgets crossed") == [["`t::a`", "100 B", "100 B", "—"]]
    # Already over its budget in the base: nothing this change crossed.
    assert render_comparison(compare_runs(head, head), head, head) == ""


def test_a_long_table_keeps_the_tests_that_fail_the_comparison() -> None:
    base = [_row(f"t::shrunk{i}", 10_000) for i in range(60)] + [_row("t::grown", 100)]
    head = [_row(f"t::shrunk{i}", 5_000) for i in range(60)] + [_row("t::grown", 200)]
    text = render_comparison(compare_runs(base, head), base, head, limit=10)
    names = [row[0] for row in _rows(text, "")]
    # Biggest change first, but the one test that grew stays although its change is smallest.
    assert len(names) == 10 and names[-1] == "`t::grown`"
    assert "_51 more tests not shown._" in text


def test_the_comment_fits_githubs_limit() -> None:
    base = [_row("t::" + "x" * 500 + str(i), 100) for i in range(200)]
    head = [_row("t::" + "x" * 500 + str(i), 200) for i in range(200)]
    text = render_comparison(compare_runs(base, head), base, head, limit=200, max_chars=20_000)
    assert len(text) <= 20_000 and text.startswith(MARKER)
    assert text.endswith("_The comment is cut here: it would pass GitHub's size limit._\n")


# What a fork's crafted report put in the bot's comment before its text was neutralised.
CRAFTED = (
    "@octocat please merge: https://evil.example/login #1 GH-2 www.evil.example "
    "<img src=x onerror=alert(1)> <!-- --> a@b.example deadbeefcafe1234 [x](https://e.example)"
)
# Live in a GitHub comment: a mention, an issue or commit reference, an autolink, HTML.
LIVE = {
    "mention": re.compile(r"(?<![\w`])@[A-Za-z0-9]"),
    "issue reference": re.compile(r"(?<![\w&])#\d|\bGH-\d", re.I),
    "commit reference": re.compile(r"\b[0-9a-f]{7,40}\b"),
    "autolink": re.compile(r"\w+://|\bwww\.", re.I),
    "HTML": re.compile(r"<[A-Za-z!/]"),
    "link": re.compile(r"(?<!\\)\]\("),
}


def _live(markdown: str) -> dict[str, list[str]]:
    """What is live outside the code spans (test names, which GitHub shows as they are)."""
    outside = re.sub(r"(`+)(?:(?!\1).)+?\1", "", markdown)
    return {kind: found for kind, rx in LIVE.items() if (found := rx.findall(outside))}


def test_a_crafted_report_says_nothing_live_in_the_comment(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    junit = ROOT / "tests" / "data" / "junit"
    head = (junit / "head.xml").read_text(encoding="utf-8")
    # A fork controls the head report: the new test's status, and every device.
    quoted = CRAFTED.replace("&", "&amp;").replace("<", "&lt;").replace('"', "&quot;")
    head = head.replace('name="vram_status" value="new"', f'name="vram_status" value="{quoted}"')
    device = 'name="vram_device" value="NVIDIA H100 80GB HBM3"'
    head = head.replace(device, f'name="vram_device" value="{quoted}"', 1)
    (tmp_path / "head.xml").write_text(head, encoding="utf-8")
    status = main(["compare", str(junit / "base.xml"), str(tmp_path / "head.xml"), "--markdown"])
    out = capsys.readouterr().out
    assert status == 1 and out.startswith(MARKER)
    assert "_Measured on different devices" in out
    assert [row[2] for row in _rows(out, "New tests")] != ["new"]
    assert _live(CRAFTED).keys() == LIVE.keys()  # the check sees each kind
    assert _live(out.removeprefix(MARKER)) == {}
    # Still legible: the words are there, with invisible breaks.
    assert "please merge" in out and "evil" in out


def test_a_crafted_report_says_nothing_live_in_the_job_summary() -> None:
    from pytest_vram.report.markdown import _text

    assert _live(_text(CRAFTED)) == {}
    assert _text("NVIDIA H100 80GB HBM3, torch 2.13.0+cpu, 5%") == (
        "NVIDIA H100 80GB HBM3, torch 2.13.0+cpu, 5%"
    )


# torch, made unimportable: the comment job installs pytest-vram without it.
NO_TORCH = """
import sys

class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None

sys.meta_path.insert(0, _NoTorch())
"""


def test_compare_and_summary_run_without_torch(tmp_path: Path) -> None:
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH, encoding="utf-8")
    junit = ROOT / "tests" / "data" / "junit"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pytest_vram", *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=120,
            check=False,
        )

    blocked = subprocess.run(
        [sys.executable, "-c", "import torch"], capture_output=True, text=True, env=env, check=False
    )
    assert "(blocked)" in blocked.stderr
    compared = run("compare", str(junit / "base.xml"), str(junit / "head.xml"), "--markdown")
    assert (compared.returncode, compared.stderr) == (1, "")
    assert compared.stdout.startswith(MARKER) and "grown beyond 5%" in compared.stdout
    plain = run("compare", str(junit / "base.xml"), str(junit / "head.xml"))
    assert plain.returncode == 1 and "FAILED" in plain.stdout, plain.stderr
    summary = run("summary", str(junit / "head.xml"))
    assert (summary.returncode, summary.stderr) == (0, "")
    assert "suites.test_training::test_train_step[llama-1b-bf16]" in summary.stdout
