"""Every file pytest-vram writes whole is written here: to a temporary file beside the target,
flushed to disk, then renamed over it. A reader sees the old file or the new one, never half of
one, whether the writer runs out of disk, is killed or is cancelled by CI.
"""

from __future__ import annotations

import contextlib
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
    file), not as mkdir's "File exists" or as the directory that could not be made."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        blocking = directory
        while not blocking.exists() and blocking.parent != blocking:
            blocking = blocking.parent
        if blocking.is_dir():  # gone in the meantime: mkdir's own words are the best there are
            raise
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(blocking)) from None


def write_atomic(
    path: Path, data: str | bytes, *, mode: int | None = None, sync: bool = True
) -> None:
    """Replace ``path`` with ``data`` (text is written as UTF-8) in one rename.

    The new file keeps the old one's permission bits, or takes ``mode``, or the umask's
    default for a new file. A symlink at ``path`` is replaced, never followed: nothing outside
    its directory is written. On any failure the target is untouched, the temporary
    file is removed, and an OSError names ``path``, never the temporary file. ``sync=False``
    skips the flush to disk, for files another process reads and deletes at once, which a
    power cut may lose.
    """
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp: str | None = None
    try:
        make_directory(path.parent)
        fd, tmp = tempfile.mkstemp(
            prefix=temporary_prefix(path), suffix=TEMPORARY_SUFFIX, dir=path.parent
        )
        with os.fdopen(fd, "wb") as handle:
            # mkstemp makes the file private; a report or baseline is as readable as any file.
            os.chmod(tmp, _mode_for(path) if mode is None else mode)
            handle.write(payload)
            handle.flush()
            if sync:
                os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
        if isinstance(exc, OSError) and _is_temporary(exc.filename, path):
            # mkstemp and the rename name the temporary file, which the user never asked for.
            exc.filename, exc.filename2 = str(path), None
        raise
    if sync:
        _sync_directory(path.parent)


def _is_temporary(filename: object, target: Path) -> bool:
    if not isinstance(filename, str):
        return False
    name = os.path.basename(filename)
    return name.startswith(temporary_prefix(target)) and name.endswith(TEMPORARY_SUFFIX)


def _sync_directory(directory: Path) -> None:
    """Flush the rename itself, so that after a power cut the name holds the new file."""
    with contextlib.suppress(OSError):  # some filesystems cannot; the file is written all the same
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _mode_for(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask
