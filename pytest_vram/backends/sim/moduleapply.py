"""``Module.to("cuda")`` and ``Module.cuda()`` for fake tensors, whose parameter swap the
stock ``Module._apply`` cannot do: installed while a shape-only simulated test runs."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["module_apply"]


class _Converted(threading.local):
    #: During one ``Module._apply``: per real parameter converted, (it, its fake one).
    params: dict[int, tuple[nn.Parameter, nn.Parameter]] | None = None


_converted = _Converted()


def module_apply(self: nn.Module, fn: Callable, recurse: bool = True) -> nn.Module:
    """``Module._apply`` for fake tensors, whose swap the stock version cannot do.

    A parameter whose conversion returns itself stays as it is; a fake parameter converted to
    another fake keeps its identity (its data is replaced, as PyTorch does by default), so that
    an optimizer made before ``.to()`` still holds it; a real parameter becomes a new fake one,
    the same one wherever the module tree holds it (tied weights stay tied: one copy, as on a
    GPU, where the parameter keeps its identity).
    """
    if _converted.params is not None:
        return _apply_converting(self, fn, recurse, _converted.params)
    _converted.params = {}
    try:
        return _apply_converting(self, fn, recurse, _converted.params)
    finally:
        _converted.params = None


def _apply_converting(
    self: nn.Module,
    fn: Callable,
    recurse: bool,
    converted: dict[int, tuple[nn.Parameter, nn.Parameter]],
) -> nn.Module:
    if recurse:
        for module in self.children():
            module._apply(fn)
    for key, param in self._parameters.items():
        if param is None:
            continue
        done = converted.get(id(param))
        if done is not None and done[0] is param:
            self._parameters[key] = done[1]
            continue
        with torch.no_grad():
            applied = fn(param)
        grad = param.grad
        if applied is not param:
            # A fake tensor's device is a Python attribute that ``.data =`` would not update.
            if (
                isinstance(param, FakeTensor)
                and isinstance(applied, FakeTensor)
                and param.fake_device == applied.fake_device
            ):
                param.data = applied
            else:
                original = param
                param = nn.Parameter(applied, requires_grad=param.requires_grad)
                self._parameters[key] = param
                converted[id(original)] = (original, param)
        if grad is not None:
            with torch.no_grad():
                grad_applied = fn(grad)
            if grad_applied is not grad:
                param.grad = grad_applied
    for key, buf in self._buffers.items():
        if buf is not None:
            self._buffers[key] = fn(buf)
    return self
