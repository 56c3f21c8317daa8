"""What writing a run's files did, and what it means for the run's exit status.

Nothing that writes at the end of a session raises: each failure becomes an error line naming
the path and the operating system's reason, the other outputs are still written, and the
caller reads :attr:`Written.errors` to fail the run without a traceback.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = [
    "Written",
    "fail_on_errors",
    "file_problem",
    "probe_directory",
    "reason_of",
    "shown_path",
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


def reason_of(exc: OSError) -> str:
    """The operating system's words, with the path where it named one."""
    reason = exc.strerror or str(exc)
    filename = exc.filename
    return f"{reason} ({filename})" if filename else reason


def shown_path(path: Path) -> str:
    """``path`` relative to the working directory where it lies below it."""
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def file_problem(path: Path, append: bool = False) -> str | None:
    """Why a file could not be written at ``path``, or None: checked before the work that
    makes it, so that a long run does not end without its output."""
    if path.is_dir():
        return "it is a directory"
    if path.exists():
        try:
            # Opening to append changes nothing in the file, and proves it can be written.
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            return reason_of(exc)
        return None
    return probe_directory(path.parent)


def probe_directory(directory: Path) -> str | None:
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
        return reason_of(exc)
    os.close(fd)
    os.unlink(probe)
    return None
