"""The error of a baseline file that cannot be read, apart so that every reader and the store
raise it without importing one another."""

from __future__ import annotations

__all__ = ["BaselineFileError"]


class BaselineFileError(Exception):
    """A baseline file that cannot be read; the message names the file and line."""
