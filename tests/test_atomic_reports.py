"""Files written whole are replaced in one rename: a full disk, a kill or an interrupt leaves
the old file as it was, never half of a new one."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from pytest_vram.atomic import make_directory, write_atomic


def hidden_files(directory: Path) -> list[str]:
    return sorted(name for name in os.listdir(directory) if name.startswith("."))


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextmanager
def file_size_limit(limit: int) -> Iterator[None]:
    """A real "File too large" (EFBIG) for any write past ``limit`` bytes, as a full disk or a
    quota fails a write part way through."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


# -- write_atomic ---------------------------------------------------------------------------


def test_writes_text_as_utf8_and_bytes_as_they_are(tmp_path: Path) -> None:
    write_atomic(tmp_path / "r.md", "| Test | Peak |\n|---|---|\n| ✓ | 1 KiB |\n")
    write_atomic(tmp_path / "snapshot.pickle", b"\x80\x04\x00")
    assert (tmp_path / "r.md").read_text(encoding="utf-8").endswith("| ✓ | 1 KiB |\n")
    assert (tmp_path / "snapshot.pickle").read_bytes() == b"\x80\x04\x00"
    assert hidden_files(tmp_path) == []


def test_makes_the_missing_directories(tmp_path: Path) -> None:
    write_atomic(tmp_path / "out" / "ci" / "r.json", "{}\n")
    assert (tmp_path / "out" / "ci" / "r.json").read_text() == "{}\n"


def test_a_new_file_takes_the_umasks_mode_not_a_private_one(tmp_path: Path) -> None:
    write_atomic(tmp_path / "r.json", "{}\n")
    assert (tmp_path / "r.json").stat().st_mode & 0o777 == 0o666 & ~umask()


def test_a_replaced_file_keeps_its_mode(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text("{}\n")
    path.chmod(0o640)
    write_atomic(path, '{"tests": []}\n')
    assert path.stat().st_mode & 0o777 == 0o640
    assert path.read_text() == '{"tests": []}\n'


def test_an_explicit_mode_wins(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.write_text("{}\n")
    write_atomic(path, "{}\n", mode=0o600)
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_write_past_the_file_size_limit_leaves_the_old_file_whole(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    old = json.dumps({"tests": ["t.py::old"]}) + "\n"
    path.write_text(old)
    path.chmod(0o640)
    with file_size_limit(4096), pytest.raises(OSError) as info:
        write_atomic(path, json.dumps({"tests": ["t.py::new"] * 10_000}))
    assert info.value.strerror == os.strerror(27)  # EFBIG: "File too large"
    assert path.read_text() == old
    assert path.stat().st_mode & 0o777 == 0o640
    assert hidden_files(tmp_path) == []


def test_an_interrupt_during_the_write_leaves_the_old_file_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "r.json"
    path.write_text("{}\n")

    def interrupted(fd: int) -> None:
        raise KeyboardInterrupt  # Ctrl-C, or CI cancelling the job, while the data is flushed

    monkeypatch.setattr(os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_atomic(path, '{"tests": []}\n')
    monkeypatch.undo()
    assert path.read_text() == "{}\n"
    assert hidden_files(tmp_path) == []


def test_a_failure_names_the_target_not_the_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "r.json"
    path.mkdir()
    with pytest.raises(OSError) as info:
        write_atomic(path, "{}\n")
    assert info.value.filename == str(path)
    assert path.is_dir() and list(path.iterdir()) == []
    assert hidden_files(tmp_path) == []


def test_a_directory_that_takes_no_new_file_is_told_by_the_targets_name(tmp_path: Path) -> None:
    directory = tmp_path / "read-only"
    directory.mkdir()
    directory.chmod(0o555)
    try:
        if os.access(directory, os.W_OK):  # root: permissions do not stop it, but /sys does
            if not Path("/sys").is_dir():
                pytest.skip("no directory here that this user cannot write")
            directory = Path("/sys")
        with pytest.raises(OSError) as info:
            write_atomic(directory / "r.json", "{}\n")
    finally:
        (tmp_path / "read-only").chmod(0o755)
    assert info.value.filename == str(directory / "r.json")
    assert not (directory / "r.json").exists()


def test_a_symlink_is_replaced_and_the_file_it_points_to_is_left_alone(tmp_path: Path) -> None:
    # A link planted where a report or cache file goes must not make the run write elsewhere.
    (tmp_path / "elsewhere").mkdir()
    other = tmp_path / "elsewhere" / "settings.json"
    other.write_text('{"keep": true}\n')
    other.chmod(0o600)
    link = tmp_path / "r.json"
    link.symlink_to(other)
    write_atomic(link, '{"tests": []}\n')
    assert not link.is_symlink()
    assert link.read_text() == '{"tests": []}\n'
    assert other.read_text() == '{"keep": true}\n'
    assert hidden_files(tmp_path) == [] and hidden_files(tmp_path / "elsewhere") == []


def test_make_directory_names_a_file_in_the_way(tmp_path: Path) -> None:
    (tmp_path / "out").write_text("not a directory")
    with pytest.raises(NotADirectoryError) as info:
        make_directory(tmp_path / "out" / "ci")
    assert info.value.filename == str(tmp_path / "out")


# -- reports in a pytest run whose writes fail part way ------------------------------------

MANY_TESTS = """
import pytest
import torch

@pytest.mark.parametrize("n", range(40))
def test_alloc(vram, n):
    x = torch.ones(256 * (n + 1))
"""

REPORTS = {
    "--vram-json": "reports/r.json",
    "--vram-markdown": "reports/r.md",
    "--vram-html": "reports/r.html",
}


def run_pytest(pytester: pytest.Pytester, size_limit: int | None = None) -> tuple[int, str]:
    """pytest in a subprocess, optionally under a file size limit that binds that run's writes
    only. Its output goes to pipes, which the limit does not bind."""

    def limit() -> None:
        if size_limit is not None:
            hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
            resource.setrlimit(resource.RLIMIT_FSIZE, (size_limit, hard))

    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    # The dispatch counter writes no files of its own; only the reports meet the limit.
    command += ["--vram-backend=cpu", "--vram-cpu-counter=dispatch"]
    command += [f"{option}={path}" for option, path in REPORTS.items()]
    process = pytester.popen(command, stdin=subprocess.DEVNULL, preexec_fn=limit, text=True)
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout + stderr


@pytest.mark.slow
def test_reports_that_cannot_be_written_whole_leave_the_old_ones_whole(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_many=MANY_TESTS)
    status, output = run_pytest(pytester)
    assert status == pytest.ExitCode.OK, output
    reports = pytester.path / "reports"
    old = {path: (reports / Path(path).name).read_bytes() for path in REPORTS.values()}

    # Each new report is as large as the old one: half its size runs out part way through.
    status, output = run_pytest(pytester, size_limit=min(map(len, old.values())) // 2)

    assert "40 passed" in output
    assert status == pytest.ExitCode.INTERNAL_ERROR, output
    for option, path in REPORTS.items():
        assert f"pytest-vram: error: cannot write {option} {path}: File too large" in output
    assert "Traceback" not in output
    for path, content in old.items():
        assert (reports / Path(path).name).read_bytes() == content, path
    assert len(json.loads(old["reports/r.json"])["tests"]) == 40
    assert sorted(os.listdir(reports)) == ["r.html", "r.json", "r.md"]


# -- a writer killed while it writes a large report ----------------------------------------

WRITER_LOOP = """
import sys
from pathlib import Path

from pytest_vram.options import Settings
from pytest_vram.units import parse_tolerance
from pytest_vram.report.outputs import write_outputs

settings = Settings(
    report=False, backend="cpu", cpu_counter="auto", sim_capacity=None,
    baseline_dir=Path("baselines"), tolerance=parse_tolerance("5%"), update_baselines=False,
    prune_baselines=False, strict=False, json_path=Path(sys.argv[1]), markdown_path=None,
    html_path=None, junit_properties=True, snapshot_dir=None,
)
# About 12 MB of JSON: 3000 tests, each with a long failure text.
tests = [
    {"nodeid": f"tests/test_model.py::test_step[{i}]", "peak_allocated": i * 4096,
     "longrepr": f"E   AssertionError: step {i}\\n" + "E   " + "x" * 4000}
    for i in range(3000)
]
run = 0
while True:
    run += 1
    document = {"run": run, "tests": tests}
    written = write_outputs(lambda: document, settings, None)
    if written.errors:
        sys.exit("\\n".join(written.errors))
    print(run, flush=True)
"""


def whole_report(path: Path) -> int:
    """The run number of the report at ``path``, which must parse and hold every test."""
    document = json.loads(path.read_bytes())
    assert len(document["tests"]) == 3000
    return document["run"]


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_a_writer_killed_while_writing_never_leaves_a_partial_report(tmp_path: Path) -> None:
    script = tmp_path / "writer_loop.py"
    script.write_text(WRITER_LOOP)
    target = tmp_path / "reports" / "r.json"
    for delay in (0.05, 0.13, 0.31, 0.47, 0.7, 1.1):
        process = subprocess.Popen(
            [sys.executable, str(script), str(target)], stdout=subprocess.PIPE, text=True
        )
        try:
            assert process.stdout is not None
            # Once one report is whole, the next writes replace it while we read and then kill.
            assert process.stdout.readline(), "the writer exited before writing a report"
            deadline = time.monotonic() + delay
            while time.monotonic() < deadline:
                whole_report(target)  # a reader meanwhile sees the old report or the new one
            os.kill(process.pid, signal.SIGKILL)
        finally:
            process.kill()
            process.wait()
        assert process.returncode == -signal.SIGKILL
        assert target.stat().st_size > 12_000_000
        assert whole_report(target) >= 1
        # What a killed writer can leave beside the target: its own hidden temporary file.
        for name in hidden_files(target.parent):
            assert name.startswith(".r.json.") and name.endswith(".tmp"), name
