"""``pytest-vram history``: the documents of successive commits, the steps up, the page and the
job-summary table; and the commit each ``--vram-json`` document names."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.cli import main
from pytest_vram.report.commit import commit_fields
from pytest_vram.report.history import HistoryError, ordered_tests, read_history, steps_markdown
from pytest_vram.report.historypage import render_history_html

MiB = 1 << 20


def _document(commit: str | None, date: str, peaks: dict[str, Any]) -> dict[str, Any]:
    """A --vram-json document as the plugin writes it, with only what history reads."""
    tests = []
    for nodeid, peak in peaks.items():
        if isinstance(peak, tuple):  # (peak, status) or several backends
            tests += [{"nodeid": nodeid, "peak_allocated": p, "status": s} for p, s in [peak]]
        else:
            tests.append({"nodeid": nodeid, "peak_allocated": peak, "status": "ok"})
    run: dict[str, Any] = {"measured": "all"}
    if commit:
        run.update(commit=commit, commit_date=date)
    return {"pytest_vram": "0.1.0", "created": date, "tests": tests, "run": run}


def _write(directory: Path, name: str, document: dict[str, Any]) -> None:
    data = json.dumps(document)
    if name.endswith(".gz"):
        with gzip.open(directory / name, "wt", encoding="utf-8") as stream:
            stream.write(data)
    else:
        (directory / name).write_text(data, encoding="utf-8")


SHAS = [f"{i:x}" * 40 for i in range(1, 6)]


@pytest.fixture
def history_dir(tmp_path: Path) -> Path:
    # Files named out of commit order: the commit's date orders them.
    _write(
        tmp_path,
        "z.json",
        _document(
            SHAS[0],
            "2026-01-01T00:00:00+00:00",
            {
                "t.py::test_a": 100 * MiB,
                "t.py::test_b": 10 * MiB,
                "t.py::test_ungated": (1, "ungated"),
                "t.py::test_skipped": (0, "skipped"),
            },
        ),
    )
    _write(
        tmp_path,
        "y.json.gz",
        _document(
            SHAS[1],
            "2026-01-02T00:00:00+00:00",
            {
                "t.py::test_a": 102 * MiB,
                "t.py::test_b": 20 * MiB,
            },
        ),
    )
    # Two shards of one commit: one point, each test's largest peak.
    _write(
        tmp_path,
        "x1.json",
        _document(
            SHAS[2],
            "2026-01-03T00:00:00+00:00",
            {
                "t.py::test_a": 150 * MiB,
            },
        ),
    )
    _write(
        tmp_path,
        "x2.json",
        _document(
            SHAS[2],
            "2026-01-03T00:00:00+00:00",
            {
                "t.py::test_b": 20 * MiB,
            },
        ),
    )
    # test_b did not run here: its next step is against its last commit that ran it.
    _write(
        tmp_path,
        "w.json",
        _document(
            SHAS[3],
            "2026-01-04T00:00:00+00:00",
            {
                "t.py::test_a": 150 * MiB,
            },
        ),
    )
    _write(
        tmp_path,
        "v.json",
        _document(
            SHAS[4],
            "2026-01-05T00:00:00+00:00",
            {
                "t.py::test_a": 140 * MiB,
                "t.py::test_b": 21 * MiB,
            },
        ),
    )
    return tmp_path


def test_series_and_steps(history_dir: Path) -> None:
    history = read_history(history_dir)
    assert [c.name for c in history.commits] == SHAS
    assert history.series == {
        "t.py::test_a": [100 * MiB, 102 * MiB, 150 * MiB, 150 * MiB, 140 * MiB],
        "t.py::test_b": [10 * MiB, 20 * MiB, 20 * MiB, None, 21 * MiB],
    }
    assert [(s.test, s.commit, s.before, s.after) for s in history.steps] == [
        ("t.py::test_a", 2, 102 * MiB, 150 * MiB),
        ("t.py::test_b", 1, 10 * MiB, 20 * MiB),
    ]
    assert ordered_tests(history) == ["t.py::test_a", "t.py::test_b"]
    # A size tolerance: test_b's 10 MiB step is within 16 MiB.
    assert [s.test for s in read_history(history_dir, "16MiB").steps] == ["t.py::test_a"]


def test_a_document_without_a_commit_is_named_by_its_file(tmp_path: Path) -> None:
    _write(tmp_path, "old.json", _document(None, "2025-01-01T00:00:00+00:00", {"t::a": 1}))
    _write(tmp_path, "new.json", _document(SHAS[0], "2026-01-01T00:00:00+00:00", {"t::a": 9}))
    history = read_history(tmp_path)
    assert [c.short for c in history.commits] == ["old.json", SHAS[0][:12]]
    assert len(history.steps) == 1


def test_unreadable_input(tmp_path: Path) -> None:
    with pytest.raises(HistoryError, match="no --vram-json documents"):
        read_history(tmp_path)
    (tmp_path / "a.json").write_text("[1]", encoding="utf-8")
    with pytest.raises(HistoryError, match="not a pytest-vram --vram-json document"):
        read_history(tmp_path)
    (tmp_path / "a.json").write_text("{", encoding="utf-8")
    with pytest.raises(HistoryError, match="cannot read it as JSON"):
        read_history(tmp_path)
    with pytest.raises(HistoryError, match="not a directory"):
        read_history(tmp_path / "missing")


def test_the_markdown_table_lists_the_largest_steps(history_dir: Path) -> None:
    text = steps_markdown(read_history(history_dir))
    assert "2 gated tests over 5 commits; 2 steps up beyond 5%." in text
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert rows == [
        f"| `t.py::test_a` | `{SHAS[2][:12]}` | 2026-01-03 | 102.00 MiB | 150.00 MiB "
        "| +48.00 MiB (+47.1%) |",
        f"| `t.py::test_b` | `{SHAS[1][:12]}` | 2026-01-02 | 10.00 MiB | 20.00 MiB "
        "| +10.00 MiB (+100.0%) |",
    ]


def test_the_page_marks_each_step_and_fetches_nothing(history_dir: Path) -> None:
    page = render_history_html(read_history(history_dir))
    assert page.count("<figure>") == 2
    # One dashed marker and one dot per step, each with the commit in its tooltip.
    assert page.count('stroke-dasharray="3 3"') == 2
    assert f"<title>{SHAS[2][:12]} 2026-01-03: +48.00 MiB (+47.1%) to 150.00 MiB</title>" in page
    # test_b's missing commit breaks its line: three commits joined, then a lone dot.
    test_b = page.split("<h3>t.py::test_b</h3>", 1)[1].split("</figure>", 1)[0]
    assert test_b.count("<polyline") == 1 and test_b.count('r="2.5"') == 1
    assert "<script" not in page and "<link" not in page
    assert re.findall(r"https?://[^\"\s]+", page) == ["http://www.w3.org/2000/svg"] * 2


def test_the_page_escapes_what_documents_say(tmp_path: Path) -> None:
    crafted = "t.py::test_x[<img src=x onerror=alert(1)>]"
    _write(tmp_path, "a.json", _document("<u>", "2026-01-01", {crafted: 1 * MiB}))
    _write(tmp_path, "b.json", _document("@octocat", "2026-01-02", {crafted: 2 * MiB}))
    history = read_history(tmp_path)
    page = render_history_html(history)
    assert "<img" not in page and "<u>" not in page and "&lt;img src=x" in page
    table = steps_markdown(history)
    assert "`@octocat`" in table and "<img" not in table.replace("`t.py::test_x[<img", "")


def test_the_page_draws_at_most_max_charts(history_dir: Path) -> None:
    page = render_history_html(read_history(history_dir), max_charts=1)
    assert page.count("<figure>") == 1 and "1 more test not drawn" in page


def test_the_command(history_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    page, table = tmp_path / "out" / "history.html", tmp_path / "steps.md"
    page.parent.mkdir()
    assert main(["history", str(history_dir), "--html", str(page), "--markdown", str(table)]) == 0
    assert "<figure>" in page.read_text(encoding="utf-8")
    assert table.read_text(encoding="utf-8").startswith("## GPU memory over the commits")
    assert main(["history", str(history_dir)]) == 0
    assert "| `t.py::test_a` |" in capsys.readouterr().out
    assert main(["history", str(tmp_path / "nothing")]) == 2
    assert "not a directory" in capsys.readouterr().err
    assert main(["history", str(history_dir), "--tolerance", "5pc"]) == 2


def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=cwd,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_fields(tmp_path: Path) -> None:
    assert commit_fields(tmp_path, environ={}) == {}
    _git(tmp_path, "init", "-q")
    (tmp_path / "f").write_text("x", encoding="utf-8")
    _git(tmp_path, "add", "f")
    _git(tmp_path, "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "HEAD")
    fields = commit_fields(tmp_path, environ={})
    assert fields["commit"] == head and re.match(r"\d{4}-\d\d-\d\dT", fields["commit_date"])
    # A workflow's $GITHUB_SHA names the commit, known to git or not.
    assert commit_fields(tmp_path, environ={"GITHUB_SHA": head}) == fields
    assert commit_fields(tmp_path, environ={"GITHUB_SHA": "f" * 40}) == {"commit": "f" * 40}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_history_of_real_runs(pytester: pytest.Pytester, capsys: pytest.CaptureFixture) -> None:
    """Three commits of a project, each run writing --vram-json; the second doubles a peak."""
    root = Path(pytester.path)
    _git(root, "init", "-q")
    (root / "reports").mkdir()
    for index, size in enumerate((1024, 2048, 2048)):
        pytester.makepyfile(
            test_mem=f"import torch\n\ndef test_t(vram):\n    x = torch.ones({size})\n"
        )
        _git(root, "add", "test_mem.py")
        _git(root, "commit", "-q", "--allow-empty", "-m", f"commit {index}")
        pytester.runpytest("--vram-backend=cpu", f"--vram-json=reports/{index}.json")
    documents = [json.loads((root / f"reports/{i}.json").read_text()) for i in range(3)]
    assert all(re.fullmatch(r"[0-9a-f]{40}", d["run"]["commit"]) for d in documents)
    capsys.readouterr()
    assert main(["history", "reports", "--html", "history.html"]) == 0
    history = read_history(root / "reports")
    assert len(history.commits) == 3
    assert [(s.commit, s.after - s.before) for s in history.steps] == [(1, 4096)]
    assert (root / "history.html").read_text().count('stroke-dasharray="3 3"') == 1


def test_the_fast_reader_agrees_with_json() -> None:
    from pytest_vram.record.record import TestRecord
    from pytest_vram.report.document import build_document
    from pytest_vram.report.documentscan import scan_document

    records = [
        TestRecord(
            nodeid='t.py::test_a["quoted\\\\"]', backend="sim", device="sim", peak_allocated=5
        ),
        TestRecord(nodeid="t.py::test_b", backend="sim", device="sim", peak_allocated=7),
        TestRecord(nodeid="t.py::test_b", backend="cpu", device="cpu", peak_allocated=9),
        TestRecord(nodeid="t.py::test_c", backend="sim", device="sim", status="ungated"),
    ]
    document = build_document(records, {}, {"measured": "marked", "commit": "c" * 40})
    text = json.dumps(document, indent=2) + "\n"
    run, created, peaks = scan_document(text)
    assert run == document["run"] and created == document["created"]
    assert peaks == {
        't.py::test_a["quoted\\\\"]': (5, "ok"),
        "t.py::test_b": (9, "ok"),
        "t.py::test_c": (0, "ungated"),
    }
    # Another layout, or the run section not last: parsed whole instead.
    assert scan_document(json.dumps(document)) is None
    moved = {"run": document["run"], **{k: v for k, v in document.items() if k != "run"}}
    assert scan_document(json.dumps(moved, indent=2)) is None


def _script() -> Any:
    import importlib.util

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location(
        "screenshot_history", root / "scripts" / "screenshot_history.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_synthetic_history_of_the_docs(tmp_path: Path) -> None:
    script = _script()
    names = script.write_history(tmp_path / "documents")
    history = read_history(tmp_path / "documents")
    assert [c.name for c in history.commits] == names
    # The training step's two steps up and the forward's one are marked; its step back
    # down, the wobble and the test added halfway are not.
    assert sorted((s.test.split("::")[1], s.commit) for s in history.steps) == [
        ("test_forward[bf16]", 22),
        ("test_training_step_fits_its_budget", 14),
        ("test_training_step_fits_its_budget", 31),
    ]
    page = render_history_html(history)
    assert page.count('stroke-dasharray="3 3"') == 3


def test_the_page_renders_in_headless_chromium(tmp_path: Path) -> None:
    script = _script()
    if script._screenshot_module().find_chromium() is None:
        pytest.skip("chromium is not installed")
    png = tmp_path / "history.png"
    assert script.main(["--output", str(png), "--html", str(tmp_path / "history.html")]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG") and len(data) > 20_000


def test_history_runs_without_torch(history_dir: Path, tmp_path: Path) -> None:
    """The publishing job of vram-history.yml installs pytest-vram without torch."""
    from test_compare_markdown import NO_TORCH

    root = Path(__file__).resolve().parent.parent
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH, encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(root)])}
    page = tmp_path / "page.html"
    done = subprocess.run(
        [sys.executable, "-m", "pytest_vram", "history", str(history_dir), "--html", str(page)],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "<figure>" in page.read_text(encoding="utf-8")
