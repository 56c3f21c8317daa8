"""Frames that Dynamo never compiles: the counting modes' own, and every frame they call.

A function that ``torch.compile`` compiles runs the parts it could not put in a graph eagerly,
with Dynamo still watching each Python frame that starts. A dispatch or function mode's handler
is such a frame when an op of those parts reaches it, and Dynamo would compile the handler and
the plugin's code below it as user code: its graphs would run the handler's own ops on the
tensors of the moment (on a fake tensor, real kernels on no data: a crash). Marked here, each
handler runs as Python, and so does every frame it calls. The mark is torch's own per code
object (what ``torch._dynamo.disable`` does per call), set without importing ``torch._dynamo``
and costing nothing per call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["keep_out_of_dynamo"]


def keep_out_of_dynamo(*functions: Callable[..., Any]) -> None:
    """Dynamo skips each function's frames and every frame they call (where this torch has
    per-code strategies; elsewhere nothing changes)."""
    frames = getattr(getattr(torch._C, "_dynamo", None), "eval_frame", None)
    with contextlib.suppress(AttributeError, TypeError):
        action = frames._FrameAction.SKIP  # type: ignore[union-attr]
        strategy = frames._FrameExecStrategy(action, action)  # type: ignore[union-attr]
        for function in functions:
            frames.set_code_exec_strategy(function.__code__, strategy)  # type: ignore[union-attr]
