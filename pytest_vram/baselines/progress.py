"""Words on stderr while a baseline file loads slowly: a big file otherwise holds up the run
without a word."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

from pytest_vram.units import format_size

__all__ = ["PROGRESS_AFTER_S", "LoadProgress"]

#: A load that takes longer than this many seconds says so on stderr.
PROGRESS_AFTER_S = 1.0


class LoadProgress:
    """Says on stderr that a load is slow, once it has taken PROGRESS_AFTER_S, and what it
    read when done. Set :attr:`entries` (and :attr:`careful`) before the block ends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.entries: int | None = None
        self.careful = False
        self._said = False
        self._lock = threading.Lock()
        self._started = time.monotonic()
        self._timer = threading.Timer(PROGRESS_AFTER_S, self._say_loading)
        self._timer.daemon = True

    def __enter__(self) -> LoadProgress:
        self._started = time.monotonic()
        self._timer.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._timer.cancel()
        elapsed = time.monotonic() - self._started
        if elapsed >= PROGRESS_AFTER_S:  # the timer may not have had its turn
            self._say_loading()
        if self._said and self.entries is not None:
            how = (
                ", with the careful YAML reader: the file is not in the layout pytest-vram "
                "writes (an update rewrites it)"
                if self.careful
                else ""
            )
            entries = f"{self.entries} {'entry' if self.entries == 1 else 'entries'}"
            with self._lock:
                _say(f"pytest-vram: loaded {entries} from {self.path} in {elapsed:.1f} s{how}")

    def _say_loading(self) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
            try:
                size = f" ({format_size(self.path.stat().st_size)})"
            except OSError:
                size = ""
            _say(f"pytest-vram: loading the baselines in {self.path}{size} ...")


def _say(line: str) -> None:
    try:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr closed or gone: the load goes on
        pass
