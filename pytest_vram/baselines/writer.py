"""A run's changes to the baseline files, merged into each file as it is when written.

Each file is read again and written under its lock, so runs that write the same file at once
(pytest-xdist controllers of several jobs, ``pytest-vram update-baselines``) lose none of each
other's work. :meth:`BaselineWriter.save` never raises: a file it cannot write is an error line.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_vram.baselines.errors import BaselineFileError
from pytest_vram.baselines.file import BaselineFile
from pytest_vram.baselines.gitignore import ensure_gitignore
from pytest_vram.baselines.layout import stored_environment
from pytest_vram.baselines.locks import locked, temporary_files_of
from pytest_vram.baselines.store import BaselineStore, check_name
from pytest_vram.record.record import TestRecord
from pytest_vram.record.status import is_stored
from pytest_vram.written import Written, reason_of, shown_path

__all__ = ["BaselineWriter"]


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
            if record.missing_ranks:  # not the maximum over every rank: keep what is stored
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
                written.errors.append(
                    f"cannot write the baselines {shown_path(path)}: {reason_of(exc)}"
                )
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
            f"baselines: {added} added, {updated} updated, {removed} removed in {shown_path(path)} "
            f"({entries} {'entry' if entries == 1 else 'entries'}"
            f"{', environment updated' if new_environment and existed else ''})"
        )

    def _changes_of(self, baseline: BaselineFile) -> _Changes:
        if baseline.path not in self._changes:
            self._changes[baseline.path] = _Changes(baseline.device)
        return self._changes[baseline.path]
