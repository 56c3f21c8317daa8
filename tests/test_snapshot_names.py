"""The file each failing test's memory snapshot is written to, and the reports that name it."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import xml.etree.ElementTree as ET
from html import escape
from pathlib import Path

import pytest

from pytest_vram.record.record import TestRecord
from pytest_vram.report import render_html, render_markdown
from pytest_vram.report.junit import junit_properties
from pytest_vram.report.terminal import render_terminal
from pytest_vram.wiring.snapshots import snapshot_name

CPU = "--vram-backend=cpu"
LONG_ID = "x" * 300
ALIKE = ["a/b", "a_b", "a:b", "a b"]


# -- the name of a test's snapshot ---------------------------------------------------------------


def test_a_long_id_gets_a_short_ascii_name_that_reads_as_the_test() -> None:
    name = snapshot_name(f"tests/test_c.py::test_long[{LONG_ID}]")
    assert name.isascii() and len(name.encode()) <= 120
    assert name.startswith("tests_test_c.py_test_long_xxx") and name.endswith(".pickle")
    # Ids that differ only past the part of the id a name keeps still get names of their own.
    assert name != snapshot_name(f"tests/test_c.py::test_long[{LONG_ID}y]")


def _names_in_another_process(nodeids: list[str]) -> list[str]:
    """The names another interpreter gives, with another seed for str hashes."""
    code = (
        "import sys\nfrom pytest_vram.wiring.snapshots import snapshot_name\n"
        "print('\\n'.join(snapshot_name(line) for line in sys.stdin.read().splitlines()))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        input="\n".join(nodeids),
        env={**os.environ, "PYTHONHASHSEED": "12345"},
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.splitlines()


def test_ids_that_read_alike_get_names_of_their_own_in_every_run() -> None:
    nodeids = [f"test_c.py::test_x[{id_}]" for id_ in ALIKE]
    names = [snapshot_name(nodeid) for nodeid in nodeids]
    assert len(set(names)) == len(ALIKE)
    assert all(name.startswith("test_c.py_test_x_a_b-") for name in names)
    # The same in the next run: a test's rerun writes over its own file, and no other.
    assert _names_in_another_process(nodeids) == names


def test_ids_that_differ_only_in_case_differ_on_a_case_insensitive_disk() -> None:
    upper = snapshot_name("test_c.py::test_x[A]")
    lower = snapshot_name("test_c.py::test_x[a]")
    assert upper.lower() != lower.lower()


def test_a_name_is_never_hidden_nor_an_option_and_always_ascii() -> None:
    for nodeid in ("...", "-k", "--", "", "test_ü.py::test_é[日本]"):
        name = snapshot_name(nodeid)
        assert name.isascii() and name[0] not in ".-", (nodeid, name)


def test_the_reports_name_a_snapshot_only_where_a_document_gives_it_as_text() -> None:
    tests = [
        {"nodeid": "t.py::test_a", "status": "failed", "snapshot": "snaps/a.pickle"},
        {"nodeid": "t.py::test_b", "status": "failed", "snapshot": 7},
        {"nodeid": "t.py::test_c", "status": "failed"},
    ]
    document = {"tests": tests}
    lines = [line for line in render_terminal(document) if "snapshot" in line]
    assert lines == ["memory snapshot of t.py::test_a: snaps/a.pickle"]
    markdown = render_markdown(document)
    assert "t.py::test_a: memory snapshot: snaps/a.pickle" in markdown
    assert markdown.count("memory snapshot") == 1
    assert render_html(document).count("memory snapshot: ") == 1


def test_a_record_carries_its_snapshot_to_the_junit_properties() -> None:
    record = TestRecord("t.py::test_a", "sim", "sim", outcome="failed", status="failed")
    assert "snapshot" not in record.to_dict()
    assert not [name for name, _ in junit_properties(record) if name == "vram_snapshot"]
    record.snapshot = "snaps/a.pickle"
    # As an xdist worker hands it to the controller.
    carried = TestRecord.from_dict(record.to_dict())
    assert junit_properties(carried)[-1] == ("vram_snapshot", "snaps/a.pickle")


# -- what a run writes and reports ---------------------------------------------------------------


def test_a_long_parametrize_id_gets_its_snapshot(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        test_c=f"""
import pytest
import torch

@pytest.mark.parametrize("p", [{LONG_ID!r}], ids=str)
def test_long(vram, p):
    kept = torch.ones(1 << 16)
    assert False, "the test's own failure"
"""
    )
    result = pytester.runpytest(CPU, "--vram-snapshot-on-fail=snaps", "--vram-json=vram.json")
    result.assert_outcomes(failed=1)
    output = result.stdout.str()
    assert "the test's own failure" in output
    assert "File name too long" not in output and "another exception occurred" not in output
    (path,) = (pytester.path / "snaps").iterdir()
    assert path.name == snapshot_name(f"test_c.py::test_long[{LONG_ID}]")
    result.stdout.fnmatch_lines([f"allocator snapshot: snaps/{path.name}"])
    (test,) = json.loads((pytester.path / "vram.json").read_text())["tests"]
    assert test["snapshot"] == f"snaps/{path.name}"
    assert pickle.loads(path.read_bytes())["device_traces"][0]


ALIKE_TESTS = """
import pytest
import torch

SIZES = {"a/b": 1, "a_b": 2, "a:b": 3, "a b": 4}

@pytest.mark.parametrize("name", list(SIZES), ids=str)
def test_x(vram, name):
    kept = torch.ones(SIZES[name] << 18)
    assert False, name
"""


def _holds(path: Path, nbytes: int) -> bool:
    """Whether the snapshot at ``path`` saw an allocation of ``nbytes``."""
    trace = pickle.loads(path.read_bytes())["device_traces"][0]
    return any(event["action"] == "alloc" and event["size"] == nbytes for event in trace)


def test_tests_whose_ids_read_alike_each_keep_their_own_snapshot(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_c=ALIKE_TESTS)
    result = pytester.runpytest(
        CPU,
        "--vram-snapshot-on-fail=snaps",
        "--vram-report",
        "--vram-json=out/vram.json",
        "--vram-markdown=out/vram.md",
        "--vram-html=out/vram.html",
        "--junitxml=out/junit.xml",
    )
    result.assert_outcomes(failed=4)
    assert len(list((pytester.path / "snaps").iterdir())) == 4

    document = json.loads((pytester.path / "out" / "vram.json").read_text())
    written = {test["nodeid"]: test["snapshot"] for test in document["tests"]}
    assert sorted(written) == sorted(f"test_c.py::test_x[{id_}]" for id_ in ALIKE)
    assert len(set(written.values())) == 4
    for megabytes, id_ in enumerate(ALIKE, start=1):
        # The file a report names is the one this test wrote: it saw this test's allocation.
        assert _holds(pytester.path / written[f"test_c.py::test_x[{id_}]"], megabytes << 20)

    junit = ET.parse(pytester.path / "out" / "junit.xml")
    markdown = (pytester.path / "out" / "vram.md").read_text()
    html = (pytester.path / "out" / "vram.html").read_text()
    rows = html.split("<tr")
    for nodeid, path in written.items():
        assert f"memory snapshot of {nodeid}: {path}" in result.outlines
        assert f"{nodeid}: memory snapshot: {path}" in markdown
        (row,) = [row for row in rows if f'<td class="test">{escape(nodeid)}</td>' in row]
        assert f"memory snapshot: {escape(path)}" in row
        name = nodeid.split("::")[1]
        case = junit.find(f".//testcase[@name='{name}']")
        assert case is not None
        properties = {p.get("name"): p.get("value") for p in case.iter("property")}
        assert properties["vram_snapshot"] == path
    # The failure's own section names the same file.
    for path in written.values():
        assert f"allocator snapshot: {path}" in result.outlines


FAILING = """
import torch
from pytest_vram import max_vram

@max_vram("1KiB")
def test_over(vram):
    x = torch.ones(1024)

def test_fails(vram):
    assert False, "the test's own failure"
"""


def test_a_snapshot_that_cannot_be_written_is_a_note(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_d=FAILING)
    blocking = pytester.path / "snaps"
    blocking.write_text("a file of the user's\n")
    result = pytester.runpytest(CPU, "--vram-snapshot-on-fail=snaps", "--vram-json=vram.json")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*exceeds max_vram(1.00 KiB)*",
            "*AssertionError: the test's own failure",
            "FAILED test_d.py::test_over - Failed: peak allocated memory*",
            "FAILED test_d.py::test_fails - AssertionError: the test's own failure",
        ],
        consecutive=False,
    )
    for test in ("test_over", "test_fails"):
        result.stdout.fnmatch_lines(
            [
                f"pytest-vram: no memory snapshot of test_d.py::{test}: cannot write "
                f"snaps/{snapshot_name(f'test_d.py::{test}')} (snaps: Not a directory)"
            ]
        )
    output = result.stdout.str()
    assert "NotADirectoryError" not in output and "another exception occurred" not in output
    assert blocking.read_text() == "a file of the user's\n"
    tests = json.loads((pytester.path / "vram.json").read_text())["tests"]
    assert [test.get("snapshot") for test in tests] == [None, None]


@pytest.mark.slow
def test_under_xdist_the_reports_name_each_workers_snapshots_and_notes(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_c=ALIKE_TESTS, test_d=FAILING)
    xdist = (CPU, "-n", "2", "-p", "xdist", "--vram-json=vram.json")
    result = pytester.runpytest_subprocess(*xdist, "--vram-snapshot-on-fail=snaps")
    result.assert_outcomes(failed=6)
    tests = json.loads((pytester.path / "vram.json").read_text())["tests"]
    written = {test["nodeid"]: test["snapshot"] for test in tests}
    nodeids = [f"test_c.py::test_x[{id_}]" for id_ in ALIKE] + [
        "test_d.py::test_over",
        "test_d.py::test_fails",
    ]
    assert written == {nodeid: f"snaps/{snapshot_name(nodeid)}" for nodeid in nodeids}
    assert all((pytester.path / path).is_file() for path in written.values())

    (pytester.path / "blocked").write_text("a file of the user's\n")
    result = pytester.runpytest_subprocess(*xdist, "--vram-snapshot-on-fail=blocked")
    result.assert_outcomes(failed=6)
    notes = [line for line in result.outlines if line.startswith("pytest-vram: no memory")]
    assert sorted(notes) == sorted(
        f"pytest-vram: no memory snapshot of {nodeid}: cannot write "
        f"blocked/{snapshot_name(nodeid)} (blocked: Not a directory)"
        for nodeid in nodeids
    )
