"""The error every ``pytest-vram`` subcommand may raise for input it cannot use.

It lives apart from the command so that subcommands raise it without importing the command
that catches it.
"""

from __future__ import annotations

__all__ = ["UsageError"]


class UsageError(Exception):
    """Command-line input a subcommand cannot use: printed as ``pytest-vram: error: ...``, exit 2.

    Not a ValueError on purpose: argparse replaces a ValueError raised by a ``type=`` callable
    with a generic "invalid value" message, while it lets other exceptions through, text intact.
    """
