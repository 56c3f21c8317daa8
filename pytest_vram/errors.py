"""The error every ``pytest-vram`` subcommand may raise for input it cannot use, the failure of
a leak check, and the warning category of the plugin.

They live apart from the command and the session so that any module raises them without
importing what catches them.
"""

from __future__ import annotations

import pytest

__all__ = ["LeakError", "UsageError", "VramWarning"]


class VramWarning(pytest.PytestWarning):
    """What pytest-vram warns about: a figure it could not check, a baseline entry without a
    test, baselines measured in another environment.

    Filter or escalate it as any warning: ``-W error::pytest_vram.VramWarning`` fails the test
    (or the run) that it is about, ``-W ignore::pytest_vram.VramWarning`` silences it.
    """


class UsageError(Exception):
    """Command-line input a subcommand cannot use: printed as ``pytest-vram: error: ...``, exit 2.

    Not a ValueError on purpose: argparse replaces a ValueError raised by a ``type=`` callable
    with a generic "invalid value" message, while it lets other exceptions through, text intact.
    """


class LeakError(AssertionError):
    """Memory grew step after step beyond the tolerance; ``result`` holds the figures (a
    :class:`~pytest_vram.measure.scenarios.LeakCheckResult`)."""

    def __init__(self, message: str, result: object) -> None:
        super().__init__(message)
        self.result = result
