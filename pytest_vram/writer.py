"""What the controller writes after the run: baseline files and the report files."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_vram.baselines import BaselineStore
from pytest_vram.records import TestRecord

if TYPE_CHECKING:
    from pytest_vram.options import Settings

__all__ = ["BaselineWriter", "write_outputs"]

# A test whose memory check failed must not become the new normal.
_NOT_STORED = frozenset({"oom", "over-budget", "leak"})


class BaselineWriter:
    """Applies updates and removals to the store and writes only the files that changed."""

    def __init__(self, store: BaselineStore, environments: dict[str, dict[str, Any]]) -> None:
        self.store = store
        self.environments = environments
        self._changed: dict[str, tuple[int, int]] = {}

    def update(self, records: list[TestRecord]) -> None:
        """Store the figures of each test that ran and passed; other entries stay untouched."""
        for record in records:
            if record.outcome != "passed" or record.status in _NOT_STORED:
                continue
            baseline = self.store.file_for(record.device)
            if baseline.entries.get(record.nodeid) != record.figures():
                baseline.entries[record.nodeid] = record.figures()
                self._count(record.device, updated=1)
            environment = self.environments.get(record.backend)
            if environment and baseline.environment != environment:
                baseline.environment = dict(environment)
                self._count(record.device)

    def prune(self, nodeids: list[str]) -> None:
        for device, baseline in self.store.files.items():
            for nodeid in nodeids:
                if baseline.entries.pop(nodeid, None) is not None:
                    self._count(device, removed=1)

    def save(self) -> list[str]:
        """Write the changed files; return a line per file for the terminal."""
        lines = []
        for device, (updated, removed) in sorted(self._changed.items()):
            baseline = self.store.files[device]
            baseline.write()
            lines.append(
                f"baselines: {updated} updated, {removed} removed in {_shown(baseline.path)} "
                f"({len(baseline.entries)} entries)"
            )
        self._changed.clear()
        return lines

    def _count(self, device: str, updated: int = 0, removed: int = 0) -> None:
        before = self._changed.get(device, (0, 0))
        self._changed[device] = (before[0] + updated, before[1] + removed)


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
        from pytest_vram.report import append_step_summary, render_markdown

        markdown = render_markdown(document)
        if settings.markdown_path is not None:
            _write(settings.markdown_path, markdown)
            lines.append(f"wrote {settings.markdown_path}")
        if step_summary:
            append_step_summary(markdown, step_summary)
    if settings.html_path is not None:
        from pytest_vram.report import render_html

        _write(settings.html_path, render_html(document))
        lines.append(f"wrote {settings.html_path}")
    return lines


def _shown(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
