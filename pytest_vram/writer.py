"""What the controller writes after the run: baseline files and the report files."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_vram.baselines import (
    BaselineFile,
    BaselineFileError,
    BaselineStore,
    check_name,
    ensure_gitignore,
    locked,
    make_directory,
    temporary_files_of,
)
from pytest_vram.records import TestRecord

if TYPE_CHECKING:
    from pytest_vram.options import Settings

__all__ = ["BaselineWriter", "Written", "write_outputs"]

# A test whose memory check failed must not become the new normal.
_NOT_STORED = frozenset({"oom", "over-budget", "leak"})


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
            if record.outcome != "passed" or record.status in _NOT_STORED:
                continue
            baseline = self.store.file_for(record.device)
            changes = self._changes_of(baseline)
            figures = record.figures()
            if baseline.entries.get(record.nodeid) != figures:
                changes.figures[record.nodeid] = figures
            environment = self.environments.get(record.backend)
            if environment and baseline.environment != environment:
                changes.environment = dict(environment)

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
) -> list[str]:
    """The JSON, Markdown and HTML files the options ask for; lines for the terminal.

    The document is built only when some output wants it.
    """
    lines: list[str] = []
    wants_markdown = settings.markdown_path is not None or (settings.report and step_summary)
    if not (settings.json_path or wants_markdown or settings.html_path):
        return lines
    document = make_document()
    if settings.json_path is not None:
        _write(settings.json_path, json.dumps(document, indent=2, sort_keys=False) + "\n")
        lines.append(f"wrote {settings.json_path}")
    if wants_markdown:
        from pytest_vram.markdown import append_step_summary, render_markdown

        markdown = render_markdown(document)
        if settings.markdown_path is not None:
            _write(settings.markdown_path, markdown)
            lines.append(f"wrote {settings.markdown_path}")
        if step_summary:
            append_step_summary(markdown, step_summary)
    if settings.html_path is not None:
        from pytest_vram.html import render_html

        _write(settings.html_path, render_html(document))
        lines.append(f"wrote {settings.html_path}")
    return lines


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


def _write(path: Path, text: str) -> None:
    make_directory(path.parent)
    path.write_text(text, encoding="utf-8")
