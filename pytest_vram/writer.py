"""What the controller writes after the run: baseline files and the report files.

Nothing here raises at the end of a session: each failure becomes an error line naming the path
and the operating system's reason, the other outputs are still written, and the caller reads
:attr:`Written.errors` to fail the run without a traceback. :func:`preflight` finds the usual
causes (a directory that is a file, a place that cannot be written) before any test runs.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from pytest_vram.atomic import write_atomic
from pytest_vram.baselines import (
    BaselineFile,
    BaselineFileError,
    BaselineStore,
    check_name,
    ensure_gitignore,
    locked,
    stored_environment,
    temporary_files_of,
)
from pytest_vram.records import TestRecord
from pytest_vram.status import is_stored

if TYPE_CHECKING:
    from pytest_vram.options import Settings

__all__ = [
    "BaselineWriter",
    "Written",
    "fail_on_errors",
    "preflight",
    "preflight_problems",
    "write_outputs",
]


@dataclass
class Written:
    """What writing the outputs did: lines for the terminal, and the errors among them."""

    lines: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __add__(self, other: Written) -> Written:
        return Written(self.lines + other.lines, self.errors + other.errors)

    def notes(self) -> list[str]:
        """Every line for the terminal, errors last and marked as such."""
        return self.lines + [f"error: {error}" for error in self.errors]


@dataclass
class _Changes:
    """This run's changes to one baseline file, applied onto whatever the file holds when it
    is written, so that runs writing the same file at once lose none of each other's work."""

    device: str
    figures: dict[str, dict[str, int]] = field(default_factory=dict)
    removed: set[str] = field(default_factory=set)
    environment: dict[str, Any] | None = None


class BaselineWriter:
    """Collects this run's updates and removals; :meth:`save` merges them into the files."""

    def __init__(self, store: BaselineStore, environments: dict[str, dict[str, Any]]) -> None:
        self.store = store
        self.environments = environments
        self._changes: dict[Path, _Changes] = {}

    def update(self, records: list[TestRecord]) -> None:
        """Store the figures of each test that ran and passed; other entries stay untouched."""
        for record in records:
            # A test whose memory check failed must not become the new normal.
            if record.outcome != "passed" or not is_stored(record.status):
                continue
            baseline = self.store.file_for(record.device)
            changes = self._changes_of(baseline)
            figures = record.figures()
            if baseline.entries.get(record.nodeid) != figures:
                changes.figures[record.nodeid] = figures
            environment = stored_environment(self.environments.get(record.backend) or {})
            if environment and baseline.environment != environment:
                changes.environment = environment

    def prune(self, nodeids: list[str]) -> None:
        for baseline in list(self.store.files.values()):
            for nodeid in nodeids:
                if nodeid in baseline.entries:
                    self._changes_of(baseline).removed.add(nodeid)

    def save(self) -> Written:
        """Merge each file's changes into the file as it is now, under its lock; never raises."""
        written = Written()
        for path, changes in sorted(self._changes.items()):
            if not (changes.figures or changes.removed or changes.environment):
                continue
            try:
                line = self._save(path, changes)
            except BaselineFileError as exc:
                written.errors.append(f"{exc}; this run's changes to it were not written")
            except OSError as exc:
                written.errors.append(f"cannot write the baselines {_shown(path)}: {_reason(exc)}")
            else:
                if line is not None:
                    written.lines.append(line)
        self._changes.clear()
        return written

    def _save(self, path: Path, changes: _Changes) -> str | None:
        with locked(path):
            ensure_gitignore(path.parent)
            # Whoever left these was killed while writing: the lock is ours, so none is live.
            for stale in temporary_files_of(path):
                stale.unlink(missing_ok=True)
            existed = path.exists()
            if existed:
                current = BaselineFile.read(path)
                check_name(current)
            else:
                current = BaselineFile(path, changes.device)
            merged = BaselineFile(
                path, current.device, dict(current.environment), dict(current.entries)
            )
            added = updated = removed = 0
            for nodeid, figures in changes.figures.items():
                before = merged.entries.get(nodeid)
                if before != figures:
                    added += before is None
                    updated += before is not None
                    merged.entries[nodeid] = figures
            for nodeid in changes.removed:
                removed += merged.entries.pop(nodeid, None) is not None
            new_environment = (
                changes.environment is not None and merged.environment != changes.environment
            )
            if new_environment:
                merged.environment = dict(changes.environment or {})
            if existed and not (added or updated or removed or new_environment):
                self.store.replace(current)
                return None
            merged.write()
        self.store.replace(merged)
        entries = len(merged.entries)
        return (
            f"baselines: {added} added, {updated} updated, {removed} removed in {_shown(path)} "
            f"({entries} {'entry' if entries == 1 else 'entries'}"
            f"{', environment updated' if new_environment and existed else ''})"
        )

    def _changes_of(self, baseline: BaselineFile) -> _Changes:
        if baseline.path not in self._changes:
            self._changes[baseline.path] = _Changes(baseline.device)
        return self._changes[baseline.path]


def write_outputs(
    make_document: Callable[[], dict[str, Any]], settings: Settings, step_summary: str | None
) -> Written:
    """The JSON, Markdown and HTML files the options ask for; never raises.

    The document is built only when some output wants it. A failure to render or write one
    output is an error line and does not stop the others.
    """
    written = Written()
    wants_markdown = settings.markdown_path is not None or bool(settings.report and step_summary)
    if not (settings.json_path or wants_markdown or settings.html_path):
        return written
    built: list[dict[str, Any]] = []
    if not _attempt(
        written, "cannot build the memory report", lambda: built.append(make_document())
    ):
        return written
    document = built[0]
    # (what a failure says, the path to name when written, what writes it), in the order
    # the lines are printed.
    outputs: list[tuple[str, Path | None, Callable[[], None]]] = []
    if settings.json_path is not None:
        path = settings.json_path
        outputs.append(
            (
                f"cannot write --vram-json {path}",
                path,
                lambda path=path: write_atomic(path, json.dumps(document, indent=2) + "\n"),
            )
        )
    if wants_markdown:
        from pytest_vram.report import append_step_summary, render_markdown

        rendered: list[str] = []
        if _attempt(
            written,
            "cannot render the Markdown report",
            lambda: rendered.append(render_markdown(document)),
        ):
            markdown = rendered[0]
            if settings.markdown_path is not None:
                path = settings.markdown_path
                outputs.append(
                    (
                        f"cannot write --vram-markdown {path}",
                        path,
                        lambda path=path: write_atomic(path, markdown),
                    )
                )
            if step_summary:
                outputs.append(
                    (
                        f"cannot append to $GITHUB_STEP_SUMMARY {step_summary}",
                        None,
                        lambda: append_step_summary(markdown, step_summary),
                    )
                )
    if settings.html_path is not None:
        from pytest_vram.report import render_html

        path = settings.html_path
        outputs.append(
            (
                f"cannot write --vram-html {path}",
                path,
                lambda path=path: write_atomic(path, render_html(document)),
            )
        )
    # Each is renamed over the old file: a full disk or a killed run leaves the last report whole.
    for failure, shown, write in outputs:
        if _attempt(written, failure, write) and shown is not None:
            written.lines.append(f"wrote {shown}")
    return written


def _attempt(written: Written, failure: str, action: Callable[[], object]) -> bool:
    """Run ``action``; on an error, add a line saying ``failure`` and why, and return False.
    An OSError is told in the operating system's words, anything else with its type."""
    try:
        action()
    except OSError as exc:
        written.errors.append(f"{failure}: {_reason(exc)}")
    except Exception as exc:
        written.errors.append(f"{failure}: {type(exc).__name__}: {exc}")
    else:
        return True
    return False


def fail_on_errors(session: pytest.Session, written: Written) -> None:
    """A run whose outputs were not all written must not pass: exit with INTERNAL_ERROR (3).

    Not TESTS_FAILED: every test may have passed, and CI should tell "the code regressed" from
    "the run could not record its results". A run that already failed keeps its status.
    """
    if written.errors and session.exitstatus in (
        pytest.ExitCode.OK,
        pytest.ExitCode.NO_TESTS_COLLECTED,
    ):
        session.exitstatus = pytest.ExitCode.INTERNAL_ERROR


# -- preflight -------------------------------------------------------------------------------


def preflight_problems(settings: Settings, environ: Mapping[str, str] | None = None) -> list[str]:
    """Why the outputs the options ask for could not be written, one line each; none when
    all can. Checked before the tests run, so that a long run does not end in an error."""
    environ = os.environ if environ is None else environ
    problems = []
    if settings.update_baselines or settings.prune_baselines:
        option = "--vram-update-baselines"
        if not settings.update_baselines:
            option = "--vram-prune-baselines"
        problem = _directory_problem(settings.baseline_dir)
        if problem:
            problems.append(
                f"{option}: cannot write baselines in {settings.baseline_dir}: {problem} "
                "(--vram-baseline-dir / vram_baseline_dir choose the directory)"
            )
    for option, path in (
        ("--vram-json", settings.json_path),
        ("--vram-markdown", settings.markdown_path),
        ("--vram-html", settings.html_path),
    ):
        problem = None if path is None else _file_problem(path)
        if problem:
            problems.append(f"{option} {path}: cannot write the report there: {problem}")
    summary = environ.get("GITHUB_STEP_SUMMARY")
    if summary and (settings.report or settings.markdown_path is not None):
        problem = _file_problem(Path(summary), append=True)
        if problem:
            problems.append(
                f"$GITHUB_STEP_SUMMARY {summary}: cannot append the memory table: {problem}"
            )
    return problems


def preflight(settings: Settings, environ: Mapping[str, str] | None = None) -> None:
    """Raise pytest.UsageError naming each output that could not be written."""
    problems = preflight_problems(settings, environ)
    if problems:
        raise pytest.UsageError("\n".join(problems))


def _directory_problem(directory: Path) -> str | None:
    """Why files could not be created in ``directory`` (made if missing), or None."""
    if directory.exists() and not directory.is_dir():
        return "it is a file, not a directory"
    return _probe(directory)


def _file_problem(path: Path, append: bool = False) -> str | None:
    if path.is_dir():
        return "it is a directory"
    if path.exists():
        try:
            # Opening to append changes nothing in the file, and proves it can be written.
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            return _reason(exc)
        return None
    return _probe(path.parent)


def _probe(directory: Path) -> str | None:
    """Create and remove a file in ``directory``, or in the nearest ancestor that exists when
    it does not (it would be made); the one check that the operating system agrees with."""
    existing = directory
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        return f"{existing} is a file, not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".pytest-vram-probe-", dir=existing)
    except OSError as exc:
        return _reason(exc)
    os.close(fd)
    os.unlink(probe)
    return None


def _reason(exc: OSError) -> str:
    """The operating system's words, with the path where it named one."""
    reason = exc.strerror or str(exc)
    filename = exc.filename
    return f"{reason} ({filename})" if filename else reason


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)
