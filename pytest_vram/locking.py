"""The one file lock of the package, for writers that must take turns: runs updating one
baseline file, pytest-xdist workers building the cpu counter's library.

The lock is the operating system's (``flock`` through ``filelock``), so it dies with its
holder, however that ends: a killed run never leaves a lock behind. The lock file stays where it
is: removing it would let a waiting process and a new one lock two different files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

__all__ = ["held"]


@contextlib.contextmanager
def held(lock_path: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold ``lock_path`` for the block, waiting at most ``timeout`` seconds (None: as long as
    it takes); TimeoutError names the file when the wait runs out."""
    from filelock import FileLock, Timeout

    lock = FileLock(str(lock_path), timeout=-1 if timeout is None else timeout)
    try:
        lock.acquire()
    except Timeout:
        raise TimeoutError(
            f"{lock_path} is held by another run and was not released in {timeout:.0f} s"
        ) from None
    try:
        yield
    finally:
        lock.release()
