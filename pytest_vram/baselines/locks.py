"""What a writer of a baseline file leaves beside it: its lock, and, when it was killed while
writing, a temporary file (named by :mod:`pytest_vram.atomic`). Writers of one file take turns
under the lock, and the one holding it clears what a killed writer left.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from pathlib import Path

from pytest_vram.atomic import TEMPORARY_SUFFIX, make_directory
from pytest_vram.locking import held

__all__ = ["LOCK_SUFFIX", "lock_path_for", "locked", "temporary_files_of"]

LOCK_SUFFIX = ".lock"


def lock_path_for(path: Path) -> Path:
    return path.with_name(f".{path.name}{LOCK_SUFFIX}")


@contextlib.contextmanager
def locked(path: Path, timeout: float = 120.0) -> Iterator[None]:
    """Hold the lock of ``path`` (a ``.NAME.lock`` file beside it) for the block; see
    :mod:`pytest_vram.locking`."""
    make_directory(path.parent)
    with held(lock_path_for(path), timeout):
        yield


def temporary_files_of(path: Path) -> list[Path]:
    """Temporary files a killed writer of ``path`` left: ours, and the mkstemp names (eight
    random characters, no suffix) of earlier versions."""
    legacy = re.compile(rf"\.{re.escape(path.name)}\.[A-Za-z0-9_]{{8}}")
    try:
        names = os.listdir(path.parent)
    except OSError:
        return []
    prefix = f".{path.name}."
    return sorted(
        path.parent / name
        for name in names
        if name.startswith(prefix)
        and (name.endswith(TEMPORARY_SUFFIX) or legacy.fullmatch(name))
        and name != lock_path_for(path).name
    )
