"""What writing a run's files did, and what it means for the run's exit status.

Nothing that writes at the end of a session raises: each failure becomes an error line naming
the path and the operating system's reason, the other outputs are still written, and the
caller reads :attr:`Written.errors` to fail the run without a traceback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest

__all__ = ["Written", "fail_on_errors", "reason_of", "shown_path"]


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
