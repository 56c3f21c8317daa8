"""Every file pytest-vram writes whole is written here: to a temporary file beside the target,
flushed to disk, then renamed over it. A reader sees the old file or the new one, never half of
one, whether the writer runs out of disk, is killed or is cancelled by CI.
"""

from __future__ import annotations

import errno
import os
import tempfile
from pathlib import Path

__all__ = ["TEMPORARY_SUFFIX", "make_directory", "temporary_prefix", "write_atomic"]

#: What a writer leaves beside its target while it writes: ``.NAME.<random>.tmp``. A writer
#: killed at the wrong moment can leave one; the name keeps it hidden and easy to ignore.
TEMPORARY_SUFFIX = ".tmp"


def temporary_prefix(path: Path) -> str:
    return f".{path.name}."


def make_directory(directory: Path) -> None:
    """``mkdir -p``, where a file in the way is told as such ("Not a directory", naming the
    file), not as mkdir's "File exists"."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        blocking = directory
        while not blocking.exists() and blocking.parent != blocking:
            blocking = blocking.parent
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(blocking)) from None


def write_atomic(path: Path, data: str | bytes, *, mode: int | None = None) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) in one rename.

    The new file keeps the old one's permission bits, or takes ``mode``, or the umask's
    default for a new file. On any failure the target is untouched and the temporary file is
    removed.
    """
    make_directory(path.parent)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(
        prefix=temporary_prefix(path), suffix=TEMPORARY_SUFFIX, dir=path.parent
    )
    try:
        with os.fdopen(fd, "wb") as handle:
            # mkstemp makes the file private; a report or baseline is as readable as any file.
            os.fchmod(handle.fileno(), _mode_for(path) if mode is None else mode)
            handle.write(payload)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
