"""A branch's memory over its commits: the ``--vram-json`` documents of successive commits read
into one series per test, with the commits where a test's peak stepped up.

``pytest-vram history DIR`` reads every ``*.json`` (and ``*.json.gz``) document in ``DIR``.
Each names its commit and the commit's date in its ``run`` section (see
:mod:`pytest_vram.report.commit`); a document without them is placed by when it was written
and named by its file. Only gated tests count, as in ``compare``: a test reported ``ungated``
was never compared with anything, and a ``skipped`` one measured nothing. A test's peak is its
largest over the backends it ran on.
:mod:`pytest_vram.report.historypage` draws the page; :func:`steps_markdown` is the table for a
job summary.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_vram.report.documentscan import scan_document
from pytest_vram.report.markdown import _code, _text
from pytest_vram.report.text import change_text, plural, size_text
from pytest_vram.units import Tolerance, parse_tolerance

__all__ = [
    "Commit",
    "History",
    "HistoryError",
    "Step",
    "ordered_tests",
    "read_history",
    "steps_markdown",
]

# Never compared (ungated) or measured nothing (skipped): no point of a test's line.
_LEFT_OUT = frozenset({"ungated", "skipped"})


class HistoryError(ValueError):
    """A directory or document that cannot be read as a history."""


@dataclass(frozen=True)
class Commit:
    """One document: the commit it measured and when."""

    #: The full commit name, or the document's file name when it names none.
    name: str
    #: The commit's date (ISO 8601), else when the document was written; may be empty.
    date: str
    path: str
    #: When the document was written: what orders commits made in the same second.
    created: str = ""

    @property
    def short(self) -> str:
        return self.name[:12] if _is_hex(self.name) else self.name


@dataclass(frozen=True)
class Step:
    """A commit where a test's peak rose beyond the tolerance over the commit before it."""

    test: str
    #: Index of the commit in :attr:`History.commits`.
    commit: int
    before: int
    after: int

    @property
    def delta(self) -> int:
        return self.after - self.before

    @property
    def percent(self) -> float | None:
        return 100.0 * self.delta / self.before if self.before else None


@dataclass
class History:
    """Per test, its peak at each commit (None where the test did not run), oldest first."""

    commits: list[Commit]
    tolerance: Tolerance
    series: dict[str, list[int | None]] = field(default_factory=dict)
    steps: list[Step] = field(default_factory=list)

    def steps_by_test(self) -> dict[str, list[Step]]:
        """Each test's steps, in commit order."""
        found: dict[str, list[Step]] = {}
        for step in sorted(self.steps, key=lambda step: step.commit):
            found.setdefault(step.test, []).append(step)
        return found


def read_history(directory: str | os.PathLike[str], tolerance: str | Tolerance = "5%") -> History:
    """Every document in ``directory``, oldest commit first, and the steps up.

    A step is a commit where a test's peak exceeds its peak at the last commit that ran it by
    more than ``tolerance``. Raises :class:`HistoryError` for a directory without documents
    or a file that is no ``--vram-json`` document.
    """
    tolerance = parse_tolerance(tolerance)
    root = Path(directory)
    if not root.is_dir():
        raise HistoryError(f"{os.fspath(directory)}: not a directory")
    paths = sorted(
        path
        for path in root.iterdir()
        if path.is_file() and path.name.endswith((".json", ".json.gz"))
    )
    if not paths:
        raise HistoryError(f"{root}: no --vram-json documents (*.json, *.json.gz) in it")
    loaded = _load_all(paths)
    # By the commit's date (to the second: commits made in one second, as a script or a
    # rebase makes them, by when their runs wrote the documents, then by file name);
    # documents of one commit (shards, reruns) merge into one point.
    loaded.sort(key=lambda item: (item[0].date, item[0].created, item[0].path))
    commits: list[Commit] = []
    peaks: list[dict[str, int]] = []
    for commit, tests in loaded:
        if commits and commits[-1].name == commit.name:
            merged = peaks[-1]
            for name, peak in tests.items():
                merged[name] = max(peak, merged.get(name, peak))
            continue
        commits.append(commit)
        peaks.append(tests)
    history = History(commits=commits, tolerance=tolerance)
    for name in sorted(set().union(*peaks)):
        history.series[name] = [at.get(name) for at in peaks]
    history.steps = _steps(history.series, tolerance)
    return history


def _steps(series: dict[str, list[int | None]], tolerance: Tolerance) -> list[Step]:
    steps = []
    for name, values in series.items():
        last: int | None = None
        for index, value in enumerate(values):
            if value is None:
                continue
            if last is not None and value - last > tolerance.allowance(last):
                steps.append(Step(name, index, last, value))
            last = value
    steps.sort(key=lambda step: (-step.delta, step.test, step.commit))
    return steps


def _load(path: Path) -> tuple[Commit, dict[str, int]]:
    """A document's commit and each gated test's peak."""
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rt", encoding="utf-8") as stream:
                text = stream.read()
        else:
            text = path.read_text(encoding="utf-8")
    except (OSError, ValueError, EOFError) as exc:
        raise HistoryError(f"{path}: cannot read it: {exc}") from None
    scanned = scan_document(text)
    if scanned is not None:
        run, created, found = scanned
        peaks = {name: peak for name, (peak, status) in found.items() if status not in _LEFT_OUT}
    else:
        run, created, peaks = _parse(path, text)
    name = run.get("commit")
    date = run.get("commit_date") or created or ""
    commit = Commit(
        name=name if isinstance(name, str) and name else path.name,
        date=date if isinstance(date, str) else "",
        path=os.fspath(path),
        created=created if isinstance(created, str) else "",
    )
    return commit, peaks


def _parse(path: Path, text: str) -> tuple[dict[str, Any], str, dict[str, int]]:
    """The document parsed whole: one the plugin did not lay out itself."""
    try:
        document = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise HistoryError(f"{path}: cannot read it as JSON: {exc}") from None
    if not isinstance(document, dict) or "pytest_vram" not in document:
        raise HistoryError(f"{path}: not a pytest-vram --vram-json document")
    run = document.get("run")
    created = document.get("created")
    peaks: dict[str, int] = {}
    tests = document.get("tests")
    for test in tests if isinstance(tests, list) else ():
        if not isinstance(test, dict) or test.get("status") in _LEFT_OUT:
            continue
        peak, nodeid = test.get("peak_allocated"), test.get("nodeid")
        if type(peak) is int and type(nodeid) is str:
            old = peaks.get(nodeid)
            if old is None or peak > old:
                peaks[nodeid] = peak
    return (
        run if isinstance(run, dict) else {},
        created if isinstance(created, str) else "",
        peaks,
    )


def _load_all(paths: list[Path]) -> list[tuple[Commit, dict[str, int]]]:
    """Every document, on each CPU core where there are many: reading is the history's cost."""
    workers = min(os.cpu_count() or 1, 8)
    if workers < 2 or len(paths) < _PARALLEL_FROM:
        return [_load(path) for path in paths]
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers) as pool:
        return list(pool.map(_load, paths, chunksize=8))


#: Documents below which the process pool costs more than it saves.
_PARALLEL_FROM = 32


def steps_markdown(history: History, limit: int = 20) -> str:
    """The largest steps as a Markdown table for a job summary; every text is neutralised."""
    lines = [
        "## GPU memory over the commits (pytest-vram)",
        "",
        f"{plural(len(history.series), 'gated test')} over {plural(len(history.commits), 'commit')}"
        f"; {plural(len(history.steps), 'step')} up beyond {_text(str(history.tolerance))}.",
    ]
    if history.steps:
        lines += [
            "",
            "| Test | Commit | Date | Before | After | Step |",
            "|---|---|---|---:|---:|---:|",
        ]
        for step in history.steps[:limit]:
            commit = history.commits[step.commit]
            lines.append(
                "| "
                + " | ".join(
                    [
                        _code(step.test),
                        _code(commit.short),
                        _text(commit.date[:10]),
                        size_text(step.before),
                        size_text(step.after),
                        change_text(step.delta, step.percent),
                    ]
                )
                + " |"
            )
        if len(history.steps) > limit:
            lines += ["", f"_{plural(len(history.steps) - limit, 'more step')} not shown._"]
    return "\n".join(lines) + "\n"


def _is_hex(text: str) -> bool:
    return len(text) >= 7 and all(c in "0123456789abcdefABCDEF" for c in text)


def ordered_tests(history: History) -> list[str]:
    """The tests, those that stepped up first (largest step first), then by latest peak."""
    stepped: dict[str, int] = {}
    for step in history.steps:
        stepped.setdefault(step.test, len(stepped))

    def latest(name: str) -> int:
        return next((v for v in reversed(history.series[name]) if v is not None), 0)

    rest = sorted((n for n in history.series if n not in stepped), key=lambda n: (-latest(n), n))
    return [*stepped, *rest]
