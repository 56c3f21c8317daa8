"""The CUDA allocator's own history (``torch.cuda.memory._record_memory_history``), kept on
for the snapshots of failing tests.

The history is the process's, one for every user of it: snapshots keep it on from test to test
(:func:`resume_history`), a leak check's sites turn it on their own way for their steps and back
to this after (:func:`history_recording` says what to go back to), and the cuda backend turns it
off when the session ends (:func:`stop_history`).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

__all__ = ["history_recording", "resume_history", "stop_history"]

# A test's allocations and frees, each with its Python stack (a few KB an entry): a test that
# makes more keeps its last ones.
_MAX_ENTRIES = 20_000
# Whether a recorder keeps the CUDA allocator's history on (a leak check's sites turn it on
# for their steps, and back to this when they are done).
_CUDA_HISTORY = {"on": False}


def history_recording() -> bool:
    """Whether the CUDA allocator's history is being recorded for snapshots."""
    return _CUDA_HISTORY["on"]


def resume_history(clear: bool = False) -> None:
    """Turn the snapshots' recording of the CUDA allocator's history (back) on; ``clear``
    drops what was recorded so far, so that a snapshot holds one test's history."""
    import torch

    record = torch.cuda.memory._record_memory_history
    settings: dict[str, Any] = {"context": "all", "stacks": "python", "max_entries": _MAX_ENTRIES}
    if clear:
        if _can_clear(record):
            settings["clear_history"] = True
        elif _CUDA_HISTORY["on"]:
            record(None)  # an older torch: turning it off drops the history
    record("all", **settings)
    _CUDA_HISTORY["on"] = True


def stop_history() -> None:
    """Turn off the recording the snapshots turned on: at the session's end."""
    if not _CUDA_HISTORY["on"]:
        return
    _CUDA_HISTORY["on"] = False
    import torch

    # A context lost to a CUDA error records nothing any more.
    with contextlib.suppress(Exception):
        torch.cuda.memory._record_memory_history(None)


def _can_clear(record: Any) -> bool:
    try:
        return "clear_history" in inspect.signature(record).parameters
    except (TypeError, ValueError):
        return False
