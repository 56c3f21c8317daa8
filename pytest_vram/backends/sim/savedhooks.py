"""Autograd's saved-tensor hooks under the simulated device's function mode.

A ``torch.autograd.graph.saved_tensors_hooks`` context (``save_on_cpu`` is one) has autograd
call its pack hook while an op saves a tensor for backward, and its unpack hook while backward
reads it back: inside a torch function that the function mode is handling, where PyTorch has
taken the mode off the stack. The factories and copies a hook calls would reach neither the
device remapping nor, with ``--vram-sim-host-tensors=host``, the placement of host tensors:
``save_on_cpu``'s ``torch.empty(..., pin_memory=True)`` would raise on a build without CUDA, or
count its host copies as device memory. While a test runs, the hooks of a context entered in it
run under the mode, as the test's own code does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch.autograd.graph
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

__all__ = ["hooks_under"]


def _under(mode_of: Callable[[], TorchFunctionMode | None], hook: Callable) -> Callable:
    @functools.wraps(hook)
    def run(*args: Any) -> Any:
        mode = mode_of()
        if mode is None or mode in _get_current_function_mode_stack():
            return hook(*args)
        with mode:
            return hook(*args)

    return run


def hooks_under(
    mode_of: Callable[[], TorchFunctionMode | None],
) -> Iterator[tuple[object, str, object]]:
    """What to set, as ``(owner, name, value)``, so that the pack and unpack hooks of a
    ``saved_tensors_hooks`` context made while it is set run under ``mode_of()`` (None: as
    they are)."""
    hooks = torch.autograd.graph.saved_tensors_hooks
    original = hooks.__init__

    def __init__(self: Any, pack_hook: Callable, unpack_hook: Callable) -> None:
        original(self, _under(mode_of, pack_hook), _under(mode_of, unpack_hook))

    yield hooks, "__init__", __init__
