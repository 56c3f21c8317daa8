"""One baseline file: read with the fastest reader that reads it exactly, written whole.

A file in the writer's layout is read by :mod:`pytest_vram.baselines.scan`, two million
entries in seconds; anything else (a hand edit, other quoting) by the careful reader of
:mod:`pytest_vram.baselines.yamlfile`. Both give the same result and the same errors. Writes go
to a temporary file renamed over the old one, so an interrupted run never leaves half a file.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_vram.atomic import write_atomic
from pytest_vram.baselines import scan, yamlfile
from pytest_vram.baselines.errors import BaselineFileError
from pytest_vram.baselines.layout import END_LINE, HEADER, dump_file
from pytest_vram.baselines.progress import LoadProgress

__all__ = ["BaselineFile", "read_careful", "read_fast"]

# The head of a file in the writer's layout (comments, device, environment) is short.
_MAX_HEAD_LINES = 10_000


@dataclass
class BaselineFile:
    path: Path
    device: str
    environment: dict[str, Any] = field(default_factory=dict)
    entries: dict[str, dict[str, int]] = field(default_factory=dict)

    def dump(self) -> str:
        """The file's text: see :func:`pytest_vram.baselines.layout.dump_file`."""
        return dump_file(self.device, self.environment, self.entries)

    def write(self) -> None:
        """Replace the file atomically: a reader sees the old file or the new one, never half."""
        # The temporary name matches GITIGNORE_PATTERNS: a writer killed here leaves nothing
        # that `git add` picks up, and the next writer under the lock removes it.
        write_atomic(self.path, self.dump())

    @classmethod
    def read(cls, path: Path) -> BaselineFile:
        """Read ``path``; BaselineFileError names the file (and line) of any fault, a file cut
        short included. A load that takes more than PROGRESS_AFTER_S says so on stderr."""
        with LoadProgress(path) as progress:
            loaded = read_fast(path)
            if loaded is None:
                progress.careful = True
                loaded = read_careful(path)
            progress.entries = len(loaded.entries)
        return loaded


def read_fast(path: Path) -> BaselineFile | None:
    """``path`` as the fast reader reads it, or None where the file is not in the writer's
    layout (or cannot be read) and :func:`read_careful` must read it. A file cut short is a
    BaselineFileError here, whichever reader would read it."""
    try:
        with open(path, "rb") as raw:
            ends_with = _closing_line(path, raw)
            raw.seek(0)
            with io.TextIOWrapper(raw, encoding="utf-8", newline="") as handle:
                return _read_layout(path, handle, ends_with)
    except (OSError, UnicodeDecodeError, scan.NotCanonical):
        return None


def read_careful(path: Path) -> BaselineFile:
    """``path`` read node by node with the safe YAML loader: slow, exact, and every error
    names its line."""
    try:
        with open(path, "rb") as raw:
            _closing_line(path, raw)
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise BaselineFileError(f"{path}: cannot read the baseline file: {exc}") from None
    parsed = yamlfile.parse(path, text)
    return BaselineFile(path, parsed.device, parsed.environment, parsed.entries)


def _closing_line(path: Path, raw: io.BufferedReader) -> str | None:
    """The line ``raw`` must end with (END_LINE where its header announces it), or
    BaselineFileError where the file was cut short."""
    start = raw.read(len(HEADER) + 8).decode("utf-8", "replace").replace("\r\n", "\n")
    if not start.startswith(HEADER):
        if start and HEADER.startswith(start):  # the whole file is the start of a header
            raise _cut_short(path, _line_count(raw))
        return None
    size = raw.seek(0, os.SEEK_END)
    raw.seek(max(0, size - 256))
    tail = raw.read().decode("utf-8", "replace").rstrip(" \t\r\n")
    if not tail.endswith("\n" + END_LINE):
        raise _cut_short(path, _line_count(raw))
    return END_LINE


def _read_layout(path: Path, handle: io.TextIOBase, ends_with: str | None) -> BaselineFile:
    """Read ``handle`` in the writer's layout: its head (up to the ``tests:`` line) with the
    careful reader, its entries with :func:`scan.read_tests`. Raises NotCanonical wherever the
    careful reader must read the file: the result is then the same, or the error is the
    careful reader's own, with its line."""
    head = []
    for line in handle:
        head.append(line)
        if line == "tests:\n":
            break
        if len(head) > _MAX_HEAD_LINES:
            raise scan.NotCanonical("a long head")
    else:
        raise scan.NotCanonical("no 'tests:' line")
    try:
        parsed = yamlfile.parse(path, "".join(head))
    except BaselineFileError:
        raise scan.NotCanonical("head") from None

    def some_entries(text: str) -> dict[str, dict[str, int]]:
        try:
            # Under a device field, so that its absence is not the error.
            return yamlfile.parse(path, f"device: d\ntests:\n{text}").entries
        except BaselineFileError:
            raise scan.NotCanonical("an entry") from None

    entries = scan.read_tests(handle, ends_with, some_entries)
    if entries and not parsed.has_device:
        raise scan.NotCanonical("no device field")
    return BaselineFile(path, parsed.device, parsed.environment, entries)


def _line_count(raw: io.BufferedReader) -> int:
    raw.seek(0)
    lines, last = 0, b"\n"
    for block in iter(lambda: raw.read(1 << 20), b""):
        lines += block.count(b"\n")
        last = block[-1:]
    return max(1, lines + (last != b"\n"))


def _cut_short(path: Path, last_line: int) -> BaselineFileError:
    return BaselineFileError(
        f"{path}:{last_line}: baseline file cut short: a whole file ends with the line "
        f"'{END_LINE}', and entries after line {last_line} may be lost; restore it with "
        f"`git checkout -- {path}`, or delete it and record its baselines again with "
        "--vram-update-baselines"
    )
