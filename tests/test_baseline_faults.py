"""Baseline files that are wrong on disk: each is an error naming the file (and line), or made
harmless, and no stored entry is ever lost."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pytest_vram.baselines.errors import BaselineFileError
from pytest_vram.baselines.file import BaselineFile
from pytest_vram.baselines.store import BaselineStore
from pytest_vram.baselines.writer import BaselineWriter
from pytest_vram.record.record import TestRecord as Record

CPU = "--vram-backend=cpu"
H100 = "NVIDIA H100 80GB HBM3"
ENV = {"cpu": {"backend": "cpu", "device": "cpu", "torch": "2.13.0"}}


def record(nodeid: str, peak: int, device: str = "cpu") -> Record:
    return Record(nodeid=nodeid, backend="cpu", device=device, peak_allocated=peak)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text).lstrip("\n"))
    return path


def error_of(path: Path) -> str:
    with pytest.raises(BaselineFileError) as info:
        BaselineFile.read(path)
    return str(info.value)


def error_line(message: str, path: Path) -> int:
    """The line number a message gives after ``path:``."""
    assert message.startswith(f"{path}:"), message
    return int(message[len(f"{path}:") :].split(":")[0])


# -- the device field ----------------------------------------------------------------------


def test_a_file_named_for_another_device_is_an_error_naming_both(tmp_path: Path) -> None:
    # Copied from cpu.yaml: the sim run would find no entries, call every test new, and an
    # update would write sim.yaml from nothing.
    write(tmp_path / "sim.yaml", "device: cpu\ntests:\n  t.py::a: {peak_allocated: 1}\n")
    with pytest.raises(BaselineFileError) as info:
        BaselineStore.load(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "sim.yaml") in message
    assert "'cpu'" in message
    assert "cpu.yaml" in message.replace(str(tmp_path / "sim.yaml"), "")


def test_two_files_of_one_device_are_an_error_naming_both(tmp_path: Path) -> None:
    write(tmp_path / "sim.yaml", "device: sim\ntests:\n  t.py::a: {peak_allocated: 1}\n")
    write(tmp_path / "sim-old.yaml", "device: sim\ntests:\n  t.py::a: {peak_allocated: 2}\n")
    with pytest.raises(BaselineFileError) as info:
        BaselineStore.load(tmp_path)
    message = str(info.value)
    assert str(tmp_path / "sim.yaml") in message
    assert str(tmp_path / "sim-old.yaml") in message
    assert "'sim'" in message


def test_two_spellings_of_one_device_name_share_its_file(tmp_path: Path) -> None:
    # The store finds a device's file by its name: the run's spelling of the device class
    # finds the entries, and an update keeps the others.
    write(
        tmp_path / "nvidia-h100-80gb-hbm3.yaml",
        """
        device: nvidia h100 80gb hbm3
        tests:
          t.py::a: {peak_allocated: 1}
          t.py::b: {peak_allocated: 2}
        """,
    )
    store = BaselineStore.load(tmp_path)
    assert store.entry(H100, "t.py::a") == {"peak_allocated": 1}
    writer = BaselineWriter(store, ENV)
    writer.update([record("t.py::a", 10, device=H100)])
    assert writer.save().errors == []
    stored = BaselineFile.read(tmp_path / "nvidia-h100-80gb-hbm3.yaml")
    assert stored.device == "nvidia h100 80gb hbm3"
    assert stored.entries == {"t.py::a": {"peak_allocated": 10}, "t.py::b": {"peak_allocated": 2}}


def test_entries_without_a_device_field_are_an_error(tmp_path: Path) -> None:
    path = write(tmp_path / "cpu.yaml", "tests:\n  t.py::a: {peak_allocated: 1}\n")
    message = error_of(path)
    assert str(path) in message
    assert "no 'device' field" in message


def test_wrong_device_in_the_run_is_a_usage_error_and_the_file_is_kept(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile("import torch\ndef test_a(vram):\n    x = torch.ones(1024)\n")
    path = write(
        pytester.path / "baselines" / "cpu.yaml",
        "device: sim\ntests:\n  test_x.py::other: {peak_allocated: 1}\n",
    )
    before = path.read_text()
    result = pytester.runpytest(CPU, "--vram-update-baselines")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*baselines/cpu.yaml: its device field is 'sim'*sim.yaml*"])
    assert path.read_text() == before


def test_a_regression_is_caught_whatever_the_device_spelling(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_a="import torch\ndef test_a(vram):\n    x = torch.ones(1024)\n")
    write(
        pytester.path / "baselines" / "cpu.yaml",
        "device: CPU\ntests:\n  test_a.py::test_a:\n    peak_allocated: 1024\n",
    )
    result = pytester.runpytest(CPU)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*memory regression: peak allocated 4.00 KiB*"])


# -- figures and keys ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "line", "words"),
    [
        ("  t.py::a:\n    peak_allocated: -1\n", 4, "never negative"),
        ("  t.py::a:\n    peak_allocated: 1.0\n", 4, "integer number of bytes, got 1.0"),
        ("  t.py::a:\n    peak_allocated: yes\n", 4, "got True"),
        ("  t.py::a:\n    peak_allocated: 0x10\n    idle: -0\n", 3, None),
        ("  t.py::a:\n    peak_allocated: 1\n    peak_allocated: 2\n", 5, "duplicate key"),
        (
            "  t.py::a: {idle: 1}\n  t.py::b: {idle: 2}\n  t.py::a: {idle: 3}\n",
            5,
            "first on line 3",
        ),
        ("  t.py::a: {idle: 1}\n  't.py::a': {idle: 2}\n", 4, "duplicate key 't.py::a'"),
        ("  t.py::a: {1: 5}\n", 3, "a figure name must be text"),
        ("  ? [a, b]\n  : {idle: 1}\n", 3, "plain value"),
    ],
)
def test_bad_figures_and_keys_name_file_and_line(
    tmp_path: Path, body: str, line: int, words: str | None
) -> None:
    path = write(tmp_path / "cpu.yaml", "device: cpu\ntests:\n" + body)
    if words is None:  # 0x10 is 16 and -0 is 0: odd but valid integers
        assert BaselineFile.read(path).entries == {"t.py::a": {"peak_allocated": 16, "idle": 0}}
        return
    message = error_of(path)
    assert error_line(message, path) == line
    assert words in message


@pytest.mark.parametrize(
    ("text", "line", "words"),
    [
        ("device: cpu\ndevice: sim\n", 2, "duplicate key 'device'"),
        ("device: cpu\ntests: {}\ntests: {}\n", 3, "duplicate key 'tests'"),
        ("device: cpu\nenvironment:\n  torch: '2.13'\n  torch: '2.12'\n", 4, "duplicate"),
        ("device: cpu\nenvironment:\n  torch: [2, 13]\n", 3, "plain value"),
        ("device: cpu\ntest:\n  t.py::a: {idle: 1}\n", 2, "unknown key 'test'"),
        ("device: [cpu]\n", 1, "'device' must be a device class"),
        ("device: ''\n", 1, "'device' is empty"),
        ("device: cpu\ntests: !!set {t.py::a: null}\n", 2, "tag"),
        ("device: cpu\ntests:\n  t.py::a: &x {idle: 1}\n  t.py::b:\n    <<: *x\n", 5, "merge"),
    ],
)
def test_bad_documents_name_file_and_line(tmp_path: Path, text: str, line: int, words: str) -> None:
    path = write(tmp_path / "cpu.yaml", text)
    message = error_of(path)
    assert error_line(message, path) == line
    assert words in message


@pytest.mark.parametrize(
    "text",
    [
        "device: cpu\ntests: [\n",
        "device: cpu\ntests:\n  t.py::a: {idle: 1\n",
        "device: cpu\ntests:\n  t.py::a: {idle: 1",
        "device: 'cpu\n",
        "device: cpu\ntests:\n  t.py::a:\n    idle: [1, 2\n\n\n",
        "tests:\n  a: {peak_allocated: 1\n",
    ],
)
def test_a_yaml_error_at_the_end_names_a_line_of_the_file(tmp_path: Path, text: str) -> None:
    path = write(tmp_path / "cpu.yaml", text)
    message = error_of(path)
    line = error_line(message, path)
    assert 1 <= line <= len(text.splitlines())
    # The line where the unclosed bracket or quote opened.
    opened = next(n for n, row in enumerate(text.splitlines(), 1) if any(c in row for c in "[{'"))
    assert line == opened


def test_a_control_character_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "cpu.yaml"
    path.write_text("device: cpu\ntests:\n  t.py::a\x07: {idle: 1}\n")
    message = error_of(path)
    assert error_line(message, path) == 3
    assert "\\x07" in message


# -- an update never rewrites a file it did not read correctly --------------------------------


@pytest.mark.parametrize(
    ("broken", "words"),
    [
        ("device: cpu\ntests:\n  t.py::a: {peak_allocated: 1\n", "cpu.yaml:3: malformed"),
        ("device: sim\ntests:\n  t.py::a: {peak_allocated: 1}\n", "its device field is 'sim'"),
    ],
)
def test_a_file_broken_during_the_run_is_not_rewritten(
    tmp_path: Path, broken: str, words: str
) -> None:
    path = write(tmp_path / "cpu.yaml", "device: cpu\ntests:\n  t.py::a: {peak_allocated: 1}\n")
    store = BaselineStore.load(tmp_path)
    path.write_text(broken)  # a hand edit, or a merge conflict, while the tests ran
    writer = BaselineWriter(store, ENV)
    writer.update([record("t.py::b", 2)])
    written = writer.save()
    assert written.lines == []
    assert len(written.errors) == 1
    assert words in written.errors[0]
    assert "not written" in written.errors[0]
    assert path.read_text() == broken


# -- a writer killed mid-write ---------------------------------------------------------------

KILLED_WRITER = """
import os, sys, time
from pathlib import Path
from pytest_vram.baselines.store import BaselineStore
from pytest_vram.baselines.writer import BaselineWriter
from pytest_vram.record.record import TestRecord

directory, marker = Path(sys.argv[1]), Path(sys.argv[2])

def fsync(fd):
    # The new text is in the temporary file, not yet renamed over the old one.
    marker.touch()
    time.sleep(120)

os.fsync = fsync
writer = BaselineWriter(BaselineStore.load(directory), {"cpu": {"torch": "2.13.0"}})
writer.update([TestRecord(nodeid="t.py::killed", backend="cpu", device="cpu", peak_allocated=9)])
writer.save()
"""


def git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_killed_writer_leaves_nothing_to_commit_and_loses_nothing(tmp_path: Path) -> None:
    repository = tmp_path / "repository"
    directory = repository / "baselines"
    writer = BaselineWriter(BaselineStore.load(directory), ENV)
    writer.update([record("t.py::a", 1)])
    assert writer.save().errors == []
    git(repository, "init", "-q")
    git(repository, "add", "-A")
    git(repository, "commit", "-q", "-m", "baselines")
    committed = (directory / "cpu.yaml").read_text()

    marker = tmp_path / "writing"
    script = tmp_path / "writer.py"
    script.write_text(KILLED_WRITER)
    process = subprocess.Popen([sys.executable, str(script), str(directory), str(marker)])
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert process.poll() is None, "the writer exited before writing"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait()
    assert process.returncode == -signal.SIGKILL

    left = [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert len(left) == 1 and left[0].startswith(".cpu.yaml.")
    assert (directory / "cpu.yaml").read_text() == committed
    # Nothing the killed run left shows in git, nor would `git add -A` take it.
    assert git(repository, "status", "--porcelain", "--untracked-files=all") == ""
    assert git(repository, "add", "-A", "--dry-run") == ""

    # The next writer gets the lock the killed one held, and clears what it left.
    writer = BaselineWriter(BaselineStore.load(directory), ENV)
    writer.update([record("t.py::b", 2)])
    assert writer.save().errors == []
    assert not [p for p in directory.iterdir() if p.name.endswith(".tmp")]
    assert BaselineFile.read(directory / "cpu.yaml").entries == {
        "t.py::a": {"peak_allocated": 1},
        "t.py::b": {"peak_allocated": 2},
    }


def test_temporary_files_of_earlier_versions_are_cleared_under_the_lock(tmp_path: Path) -> None:
    write(tmp_path / "cpu.yaml", "device: cpu\ntests:\n  t.py::a: {peak_allocated: 1}\n")
    (tmp_path / ".cpu.yaml.k3j_x9q2").write_text("half a fi")  # mkstemp's name, no suffix
    (tmp_path / ".cpu.yaml.notes").write_text("not ours")
    writer = BaselineWriter(BaselineStore.load(tmp_path), ENV)
    writer.update([record("t.py::b", 2)])
    assert writer.save().errors == []
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [".cpu.yaml.lock", ".cpu.yaml.notes", ".gitignore", "cpu.yaml"]


def test_the_gitignore_keeps_a_users_lines(tmp_path: Path) -> None:
    (tmp_path / ".gitignore").write_text("*.bak")
    writer = BaselineWriter(BaselineStore.load(tmp_path), ENV)
    writer.update([record("t.py::a", 1)])
    writer.save()
    assert (tmp_path / ".gitignore").read_text() == "*.bak\n.*.lock\n.*.tmp\n"
    writer.update([record("t.py::a", 2)])
    writer.save()
    assert (tmp_path / ".gitignore").read_text() == "*.bak\n.*.lock\n.*.tmp\n"


# -- a file cut short --------------------------------------------------------------------------


def cut_short(path: Path) -> str:
    """Cut ``path`` after its second entry, as a full disk or an interrupted copy leaves it."""
    text = path.read_text()
    cut = text[: text.index("  test_a.py::test_c:")]
    path.write_text(cut)
    return cut


@pytest.mark.parametrize("update", [False, True])
def test_a_file_cut_short_stops_the_run_naming_it_and_is_not_rewritten(
    pytester: pytest.Pytester, update: bool
) -> None:
    pytester.makepyfile(
        test_a="""
        import torch

        def test_a(vram):
            x = torch.ones(1024)

        def test_b(vram):
            x = torch.ones(1024)

        def test_c(vram):
            x = torch.ones(1024)
        """
    )
    assert pytester.runpytest(CPU, "--vram-update-baselines").ret == pytest.ExitCode.OK
    path = pytester.path / "baselines" / "cpu.yaml"
    assert len(BaselineFile.read(path).entries) == 3
    cut = cut_short(path)

    result = pytester.runpytest(CPU, *(["--vram-update-baselines"] if update else []))
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            f"*{path}:{cut.count(chr(10))}: baseline file cut short*"
            f"restore it with `git checkout -- {path}`*--vram-update-baselines*"
        ]
    )
    assert "Traceback" not in result.stderr.str()
    assert path.read_text() == cut


def test_a_file_of_the_previous_version_is_compared_and_rewritten_whole(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_a="import torch\ndef test_a(vram):\n    x = torch.ones(1024)\n")
    path = write(
        pytester.path / "baselines" / "cpu.yaml",
        """
        # pytest-vram baselines: peak memory per test, in bytes, for one device class.
        # Update after an intended change with: pytest --vram-update-baselines
        device: cpu
        environment:
          torch: 2.13.0
        tests:
          test_a.py::test_a:
            peak_allocated: 1024
          test_a.py::test_gone:
            peak_allocated: 7
        """,
    )
    result = pytester.runpytest(CPU)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*memory regression: peak allocated 4.00 KiB*"])

    assert pytester.runpytest(CPU, "--vram-update-baselines").ret == pytest.ExitCode.OK
    text = path.read_text()
    assert text.splitlines()[-1] == "# end of baselines"
    assert BaselineFile.read(path).entries == {
        "test_a.py::test_a": {"peak_allocated": 4096, "peak_temporaries": 4096},
        "test_a.py::test_gone": {"peak_allocated": 7},
    }
