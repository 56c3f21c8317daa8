"""Shape-only attempts that took the process down: found by the next run, which computes them.

A shape-only run executes a test's code on fake tensors, which code below the dispatcher may
not survive (a segmentation fault in a library's C++ that writes into a tensor without data).
Such a crash takes the whole pytest process with it, unseen. So before each shape-only attempt
the process writes the test's id to a file of its own, and empties it when the attempt returns;
while the process lives it holds a lock on that file. A run that finds such a file with a test
in it and no one holding its lock knows that the process died in that test's shape-only run:
the test is remembered in pytest's cache (``vram/crashed``; ``--cache-clear`` forgets) and
computes from the start, in that run and the ones after it, and the run says so.

The files are in pytest's cache directory (``.pytest_cache/d/vram-attempts``), one per process
(an xdist worker has its own); the process that is not an xdist worker (the controller, or the
one process) reads them when the run starts and when it ends.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["CRASHED_CACHE_KEY", "ShapeOnlyAttempts"]

#: pytest's cache key of the tests whose shape-only run took their process down.
CRASHED_CACHE_KEY = "vram/crashed"
_DIRECTORY = "vram-attempts"


class ShapeOnlyAttempts:
    """This process's record of the shape-only attempt in progress, and the tests that an
    earlier process died in. ``cache`` is pytest's (None: nothing is recorded); ``reads``:
    whether this process looks for the files of processes that died (not an xdist worker)."""

    def __init__(self, cache: Any, *, reads: bool) -> None:
        self._cache = cache
        self._directory: Path | None = None
        self._fd: int | None = None
        self._lock: Any = None
        self._closed = False
        listed = cache.get(CRASHED_CACHE_KEY, []) if cache is not None else []
        #: The tests that compute from the start because a shape-only run of theirs crashed.
        self.crashed: set[str] = (
            {n for n in listed if isinstance(n, str)} if isinstance(listed, list) else set()
        )
        #: What this run has to say of them.
        self.notes: list[str] = []
        if reads:
            self.look_for_crashes(starting=True)

    def _folder(self) -> Path | None:
        if self._directory is None and self._cache is not None:
            try:
                self._directory = Path(self._cache.mkdir(_DIRECTORY))
            except OSError:  # a read-only checkout: nothing is recorded
                self._cache = None
        return self._directory

    # -- this process's attempts ------------------------------------------------------------

    @contextlib.contextmanager
    def trying(self, nodeid: str) -> Iterator[None]:
        """Around a shape-only attempt of ``nodeid``: recorded while it runs."""
        fd = self._fd if self._fd is not None else self._open()
        if fd is None:
            yield
            return
        data = json.dumps({"test": nodeid}).encode()
        # Written straight to the file: what the kernel holds survives the process.
        os.lseek(fd, 0, os.SEEK_SET)
        os.write(fd, data)
        try:
            yield
        finally:
            os.ftruncate(fd, 0)

    def _open(self) -> int | None:
        """This process's file, locked for as long as the process lives."""
        folder = None if self._closed else self._folder()
        if folder is None:
            return None
        from filelock import FileLock

        stem = folder / str(os.getpid())
        lock = FileLock(str(stem.with_suffix(".lock")), timeout=0)
        try:
            lock.acquire()
            self._fd = os.open(stem.with_suffix(".json"), os.O_RDWR | os.O_CREAT | os.O_TRUNC)
        except Exception:  # a file system without locks: nothing is recorded
            with contextlib.suppress(Exception):
                lock.release()
            self._closed = True
            return None
        self._lock = lock
        return self._fd

    def close(self) -> None:
        """The process ends normally: its file goes."""
        self._closed = True
        fd, self._fd = self._fd, None
        if fd is None:
            return
        os.close(fd)
        folder = self._directory
        assert folder is not None
        stem = folder / str(os.getpid())
        with contextlib.suppress(OSError):
            stem.with_suffix(".json").unlink()
        lock, self._lock = self._lock, None
        with contextlib.suppress(Exception):
            lock.release()
        with contextlib.suppress(OSError):
            stem.with_suffix(".lock").unlink()

    # -- processes that died ----------------------------------------------------------------

    def look_for_crashes(self, *, starting: bool) -> None:
        """Adopt the tests that processes died in (their files, whose locks no one holds);
        ``starting``: this run computes them, else the next one does."""
        folder = self._folder() if self._cache is not None else None
        if folder is None:
            return
        from filelock import FileLock, Timeout

        found = []
        for lock_path in sorted(folder.glob("*.lock")):
            if lock_path.stem == str(os.getpid()):
                continue
            lock = FileLock(str(lock_path), timeout=0)
            try:
                lock.acquire()
            except (Timeout, OSError):  # its process is alive (another run, a worker)
                continue
            try:
                test = _test_in(lock_path.with_suffix(".json"))
                if test is not None:
                    found.append(test)
                with contextlib.suppress(OSError):
                    lock_path.with_suffix(".json").unlink()
            finally:
                lock.release()
                with contextlib.suppress(OSError):
                    lock_path.unlink()
        new = [test for test in found if test not in self.crashed]
        if not new:
            return
        self.crashed.update(new)
        self._cache.set(CRASHED_CACHE_KEY, sorted(self.crashed))
        who = "a process of an earlier run" if starting else "an xdist worker of this run"
        when = "in this run and the ones after it" if starting else "in the runs after this one"
        for test in new:
            self.notes.append(
                f"{test}: {who} died while this test ran shape-only (killed, or a crash in "
                f"native code on fake tensors); it computes from the start {when} (pytest "
                "--cache-clear forgets)"
            )


def _test_in(path: Path) -> str | None:
    """The test a process's file names, if any."""
    try:
        data = json.loads(path.read_bytes() or b"null")
    except (OSError, ValueError):
        return None
    test = data.get("test") if isinstance(data, dict) else None
    return test if isinstance(test, str) else None
