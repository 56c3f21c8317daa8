"""What a test raised: whether it is an out-of-memory error; and releasing the frames it holds,
so that the next test starts clean.

The frames of a test that raised keep its locals (and so its tensors) alive: through the
exception pytest keeps for the report, through the traceback's cycle with pytest's CallInfo,
and, after a failed call, through ``sys.last_value`` for post-mortem debugging.
"""

from __future__ import annotations

import sys
import traceback
from types import FrameType

__all__ = ["is_out_of_memory", "release_exception", "release_quietly"]


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether ``exc`` says the device (or the host, for the cpu backend) ran out of memory."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    # The CPU allocator reports exhaustion as a plain RuntimeError.
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def release_exception(exc: BaseException) -> None:
    """Clear the frames of ``exc`` (and of the exceptions it chains to) and drop the
    post-mortem references to it, so that the tensors its frames hold are freed."""
    _release_frames(exc)
    if getattr(sys, "last_value", None) is exc:
        for name in ("last_type", "last_value", "last_traceback", "last_exc"):
            if hasattr(sys, name):
                delattr(sys, name)


def release_quietly(*excs: BaseException) -> None:
    """:func:`release_exception` each of ``excs``, dropping what the objects their frames
    held raise as they go (``__del__`` of an object left half-built when the run that made it
    is withdrawn)."""
    hook, sys.unraisablehook = sys.unraisablehook, _drop
    try:
        for exc in excs:
            release_exception(exc)
    finally:
        sys.unraisablehook = hook


def _drop(unraisable: object) -> None:
    pass


def _release_frames(exc: BaseException | None) -> None:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        traceback.clear_frames(tb)
        if tb is not None:
            _clear_finished_callers(tb.tb_frame)
        while tb is not None:
            # Python 3.11 keeps a materialised f_locals dict after frame.clear(); reading it
            # again syncs it with the now empty frame.
            tb.tb_frame.f_locals  # noqa: B018
            # A cleared frame still holds its function, and a closure's cells what the step
            # computed. Unlink the traceback, so that whoever keeps the exception (pytest's
            # CallInfo, a hook recorder) keeps none of the frames below the one that caught it.
            tb.tb_next, tb = None, tb.tb_next
        if exc.__cause__ is not None:
            _release_frames(exc.__cause__)
        exc = exc.__context__


def _clear_finished_callers(frame: FrameType) -> None:
    """Clear the finished frames that called ``frame``: pytest's CallInfo for the failed call
    sits in one of them, and with the traceback it forms a cycle that keeps the test's
    closures alive. The first frame still running ends the walk."""
    caller = frame.f_back
    while caller is not None:
        try:
            caller.clear()
        except RuntimeError:  # still executing: everything above it is too
            return
        caller = caller.f_back
