"""The report files a run writes: JSON, Markdown (and the GitHub job summary), HTML."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

CPU = "--vram-backend=cpu"

TESTS = """
import torch
from pytest_vram import max_vram

def test_small(vram):
    x = torch.ones(1024)

@max_vram("1KiB")
def test_over(vram):
    x = torch.ones(1024)

def test_leak_checked(vram):
    vram.leak_check(lambda: torch.ones(64).sum(), steps=20)
"""


def test_json_markdown_and_html_files(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mem=TESTS)
    result = pytester.runpytest(
        CPU, "--vram-json=out/vram.json", "--vram-markdown=out/vram.md", "--vram-html=out/vram.html"
    )
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(
        ["pytest-vram: wrote out/vram.json", "pytest-vram: wrote out/vram.md"]
    )
    document = json.loads((pytester.path / "out" / "vram.json").read_text())
    assert document["environments"]["cpu"]["backend"] == "cpu"
    assert document["totals"] == {"measured": 3, "over-budget": 1, "new": 2}
    over, *_ = document["tests"]
    assert over["nodeid"] == "test_mem.py::test_over"
    assert over["budgets"] == [
        {"limit": 1024, "metric": "allocated", "peak": 4096, "as_written": "1KiB", "passed": False}
    ]
    assert "exceeds max_vram(1.00 KiB)" in over["messages"][0]
    leak = next(t for t in document["tests"] if t["nodeid"].endswith("test_leak_checked"))
    assert len(leak["scenarios"]["leak_check"]["per_step"]) == 20
    markdown = (pytester.path / "out" / "vram.md").read_text()
    assert "test_mem.py::test_over" in markdown and "over-budget" in markdown
    html = (pytester.path / "out" / "vram.html").read_text()
    assert html.startswith("<!DOCTYPE html>") and "test_leak_checked" in html
    assert "<svg" in html and "http://" not in html.replace("http://www.w3.org", "")


def test_github_step_summary_is_appended(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_mem=TESTS)
    summary = pytester.path / "summary.md"
    summary.write_text("# Earlier step\n")
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    pytester.runpytest(CPU, "--vram-report")
    text = summary.read_text()
    assert text.startswith("# Earlier step\n")
    assert "test_mem.py::test_over" in text
    # Without --vram-report or --vram-markdown the summary is left alone.
    summary.write_text("untouched\n")
    pytester.runpytest(CPU)
    assert summary.read_text() == "untouched\n"


@pytest.mark.slow
def test_junit_properties_under_xdist(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mem=TESTS)
    result = pytester.runpytest_subprocess(CPU, "-n", "2", "-p", "xdist", "--junitxml=out.xml")
    result.assert_outcomes(passed=2, failed=1)

    root = ET.parse(pytester.path / "out.xml").getroot()
    cases = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in root.iter("testcase")
    }
    assert cases["test_small"]["vram_peak_allocated"] == "4096"
    assert cases["test_over"]["vram_status"] == "over-budget"
    suite = {p.get("name"): p.get("value") for p in root.find("testsuite/properties")}
    assert suite["vram_env_backend"] == "cpu"


@pytest.mark.slow
def test_peak_reserved_property_on_sim_not_on_cpu(pytester: pytest.Pytester) -> None:
    # sim models the caching allocator's segments; the cpu backend has no reserved figure.
    pytester.makepyfile(
        test_mem="""
        import pytest
        import torch

        def test_sim(vram):
            x = torch.ones(1024, device=vram.device)

        @pytest.mark.vram_backend("cpu")
        def test_cpu(vram):
            x = torch.ones(1024, device=vram.device)
        """
    )
    # A subprocess: the simulated device imports parts of torch that cannot be imported twice.
    result = pytester.runpytest_subprocess("--vram-backend=sim", "--junitxml=out.xml")
    result.assert_outcomes(passed=2)
    root = ET.parse(pytester.path / "out.xml").getroot()
    found = {
        case.get("name"): {p.get("name"): p.get("value") for p in case.iter("property")}
        for case in root.iter("testcase")
    }
    assert found["test_sim"]["vram_backend"] == "sim"
    assert found["test_sim"]["vram_peak_reserved"] == str(2 * 1024**2)  # one small segment
    assert found["test_cpu"]["vram_backend"] == "cpu"
    assert "vram_peak_reserved" not in found["test_cpu"]
    for name in ("test_sim", "test_cpu"):
        assert "vram_peak_device" not in found[name]  # NVML, cuda only


def test_terminal_report_is_the_table_and_totals(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mem=TESTS)
    result = pytester.runpytest(CPU, "--vram-report")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.re_match_lines(
        [
            r"=+ vram report =+",
            r"test\s+backend\s+peak\s+increment\s+leftover\s+baseline\s+change\s+status",
            r"test_mem.py::test_over\s+cpu\s+4.00 KiB\s+4.00 KiB\s+0 B\s+-\s+-\s+over-budget",
            r"3 measured tests: 1 over-budget, 2 new",
        ]
    )
