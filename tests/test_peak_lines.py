"""The peak by source line: a gated test that fails or regresses runs once more with the lines of
the user's code recorded; passing tests never do. Real pytest runs on sim and cpu."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.cli import main
from pytest_vram.report.peakchange import flagged_tests, read_peak_line

# Each run appends a line to runs.txt, so a test can count its own runs. The budget fails on
# the big tensor: 4 MiB of ones at line 11, 1 MiB at line 12, 4 MiB more at line 13.
SOURCE = """
import torch
from pytest_vram import max_vram


def note(name):
    with open("runs.txt", "a") as stream:
        stream.write(name + "\\n")


def make():
    big = torch.ones(1024, 1024)
    small = torch.ones(256, 1024)
    return big + 1, small


@max_vram("1MiB")
def test_over(vram):
    note("over")
    print("printed once")
    x, y = make()


@max_vram("1GiB")
def test_within(vram):
    note("within")
    x, y = make()


def test_ungated():
    note("ungated")
    x, y = make()
"""


def _run(pytester: pytest.Pytester, backend: str, *args: str) -> tuple[Any, dict[str, Any]]:
    pytester.makepyfile(test_lines=SOURCE)
    result = pytester.runpytest(
        f"--vram-backend={backend}",
        "--vram-report",
        "--vram-json=out.json",
        "--junitxml=out.xml",
        "-p",
        "no:randomly",
        *args,
    )
    document = json.loads((Path(pytester.path) / "out.json").read_text(encoding="utf-8"))
    return result, {test["nodeid"].split("::")[-1]: test for test in document["tests"]}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["sim", "cpu"])
def test_a_failing_test_gets_its_lines_on_a_rerun(pytester: pytest.Pytester, backend: str) -> None:
    result, tests = _run(pytester, backend)
    result.assert_outcomes(passed=2, failed=1)
    runs = (Path(pytester.path) / "runs.txt").read_text().split()
    # Only the failing test ran twice; its first run is the one reported.
    assert sorted(runs) == ["over", "over", "ungated", "within"]
    assert result.stdout.str().count("printed once") == 1
    lines = tests["test_over"]["peak_lines"]
    assert lines[0] == {
        "file": "test_lines.py",
        "line": 11,
        "text": "big = torch.ones(1024, 1024)",
        "bytes": 4 << 20,
        "category": "temporaries",
    }
    assert [(entry["line"], entry["bytes"]) for entry in lines[:3]] == [
        (11, 4 << 20),
        (13, 4 << 20),
        (12, 1 << 20),
    ]
    assert "peak_lines" not in tests["test_within"]
    assert "peak_lines" not in tests.get("test_ungated", {})
    junit = (Path(pytester.path) / "out.xml").read_text(encoding="utf-8")
    assert 'name="vram_peak_line_1" value="4194304 temporaries test_lines.py:11 big = ' in junit


@pytest.mark.slow
def test_all_and_no(pytester: pytest.Pytester) -> None:
    _, tests = _run(pytester, "sim", "--vram-peak-lines=all")
    assert "peak_lines" in tests["test_over"] and "peak_lines" in tests["test_within"]
    assert "peak_lines" not in tests.get("test_ungated", {})  # not gated: never rerun
    (Path(pytester.path) / "runs.txt").unlink()
    _, tests = _run(pytester, "sim", "--vram-peak-lines=no")
    assert "peak_lines" not in tests["test_over"]
    assert sorted((Path(pytester.path) / "runs.txt").read_text().split()) == [
        "over",
        "ungated",
        "within",
    ]


@pytest.mark.slow
def test_flagged_lists_them_for_the_base_pass(
    pytester: pytest.Pytester, capsys: pytest.CaptureFixture[str]
) -> None:
    _run(pytester, "sim")
    capsys.readouterr()
    assert main(["flagged", "out.json"]) == 0
    assert capsys.readouterr().out == "test_lines.py::test_over\n"
    # pytest reads the list as arguments: the second pass runs exactly those tests.
    Path(pytester.path, "flagged.txt").write_text("test_lines.py::test_over\n")
    result = pytester.runpytest(
        "--vram-backend=sim", "--vram-peak-lines=all", "--vram-json=lines.json", "@flagged.txt"
    )
    result.assert_outcomes(failed=1)
    document = json.loads(Path(pytester.path, "lines.json").read_text())
    assert [t["nodeid"] for t in document["tests"]] == ["test_lines.py::test_over"]
    assert document["tests"][0]["peak_lines"]


def test_flagged_leaves_out_what_is_no_plain_node_id() -> None:
    rows = [
        {"name": "t.py::test_a", "vram_status": "regression"},
        {"name": "t.py::test_b", "vram_status": "ok", "vram_peak_lines": []},
        {"name": "t.py::test_c", "vram_status": "ok"},
        {"name": "t.py::test_d", "vram_status": "ungated", "vram_peak_lines": []},
        {"name": "--basetemp=/::x", "vram_status": "leak"},
        {"name": "-p evil", "vram_status": "leak"},
        {"name": "@other.txt", "vram_status": "leak"},
        {"name": "../outside.py::test", "vram_status": "leak"},
        {"name": "/abs.py::test", "vram_status": "leak"},
        {"name": "t.py::test_a", "vram_status": "regression"},
    ]
    assert flagged_tests(rows) == ["t.py::test_a", "t.py::test_b"]


def test_a_junit_line_reads_back() -> None:
    assert read_peak_line("1610612736 activations model.py:54 attn = q @ k.transpose(-2, -1)") == {
        "file": "model.py",
        "line": 54,
        "text": "attn = q @ k.transpose(-2, -1)",
        "bytes": 1610612736,
        "category": "activations",
    }
    assert read_peak_line("a line of another shape") is None


def test_the_html_report_lists_the_lines() -> None:
    from pytest_vram.record.record import TestRecord
    from pytest_vram.report.document import build_document
    from pytest_vram.report.html import render_html

    record = TestRecord(nodeid="t.py::test_a", backend="sim", device="sim", status="regression")
    record.peak_lines = [
        {
            "file": "m.py",
            "line": 3,
            "text": "x = a <b> & c",
            "bytes": 1 << 20,
            "category": "activations",
        }
    ]
    page = render_html(build_document([record], {}))
    assert "<h2>Lines alive at the peak</h2>" in page
    assert '<td class="test">m.py:3</td><td class="test">x = a &lt;b&gt; &amp; c</td>' in page
    assert "<td>activations</td>" in page


@pytest.mark.slow
def test_lines_ride_with_a_pytest_xdist_workers_record(pytester: pytest.Pytester) -> None:
    result, tests = _run(pytester, "sim", "-n", "2")
    result.assert_outcomes(passed=2, failed=1)
    assert tests["test_over"]["peak_lines"][0]["line"] == 11
    assert "peak_lines" not in tests["test_within"]


class _Counting:
    """What the recorder asks of a backend that has no tracker of its own (cpu's allocator
    counter, cuda): which tensors count. Here: those on the CPU."""

    tracker = None

    @staticmethod
    def attribution_filter(tensor: Any) -> bool:
        return tensor.device.type == "cpu"


def _allocate() -> Any:
    import torch

    kept = torch.ones(256, 1024)  # 1 MiB, alive at the peak
    freed = torch.ones(1024, 1024)  # 4 MiB, freed before the peak
    del freed
    more = torch.zeros(512, 1024)  # 2 MiB, alive at the peak
    return kept, more


def test_the_recorder_sums_the_lines_alive_at_the_peak() -> None:
    from pytest_vram.attribution.peaklines import PeakLineRecorder

    recorder = PeakLineRecorder(_Counting(), root=Path(__file__).parent)  # type: ignore[arg-type]
    assert recorder.available and recorder.start()
    kept = _allocate()
    lines = recorder.stop()
    del kept
    # The peak was the 4 MiB tensor with the 1 MiB one: 5 MiB against 3 MiB later.
    assert [(entry["text"], entry["bytes"]) for entry in lines] == [
        # Each line's text with its runs of spaces made one.
        ("freed = torch.ones(1024, 1024) # 4 MiB, freed before the peak", 4 << 20),
        ("kept = torch.ones(256, 1024) # 1 MiB, alive at the peak", 1 << 20),
    ]
    assert {entry["file"] for entry in lines} == {"test_peak_lines.py"}
    assert {entry["category"] for entry in lines} == {"temporaries"}
    assert recorder.stop() == []  # stopped once
