"""TorchScript on the simulated device: it runs computing only.

TorchScript's executor and tracer work below the dispatcher on what a tensor holds: the
graph executor folds constants by writing into tensors, the tracer records the tensors it
meets. Shape-only, on fake tensors that have no data, that is a segmentation fault, which would
take the whole pytest process with it. While a test runs shape-only, every way into TorchScript
that runs or traces code (calling a scripted or traced function, module or method, tracing,
freezing) raises :class:`TorchScriptShapeOnly` before anything runs; values on demand then runs
the test again computing, on real CPU tensors, where TorchScript is safe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["TorchScriptShapeOnly", "shape_only_replacements"]

_C = torch._C


class TorchScriptShapeOnly(BaseException):
    """TorchScript was called while the test ran shape-only.

    A BaseException, as pytest's own outcomes are: a test's ``except Exception`` around the
    call (a library's fallback from scripted to eager code) would otherwise run on, shape-only,
    and the test would not compute.
    """


def _refuse(what: str, original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise TorchScriptShapeOnly(
            f"this test {what}, which runs only on tensors that hold values: shape-only, on "
            "the simulated device's fake tensors, TorchScript would crash the process. With "
            "--vram-sim-compute=auto (the default) the test runs again computing its values "
            "on the CPU, with the same figures; --vram-sim-compute=always computes from the "
            "start"
        )

    return refuse


# (owner, attribute, what the test does when it reaches it). Tracing a function or a module
# ends in one of the _create_*_from_trace functions; the rest run compiled code.
_ENTRIES: tuple[tuple[Any, str, str], ...] = (
    (_C.ScriptFunction, "__call__", "calls a TorchScript function (scripted or traced)"),
    (_C.ScriptMethod, "__call__", "calls a TorchScript module (scripted or traced)"),
    (_C, "_create_function_from_trace", "traces a function with torch.jit.trace"),
    (_C, "_create_function_from_trace_with_dict", "traces a function with torch.jit.trace"),
    (_C.ScriptModule, "_create_method_from_trace", "traces a module with torch.jit.trace"),
    (
        _C.ScriptModule,
        "_create_method_from_trace_with_dict",
        "traces a module with torch.jit.trace",
    ),
    (_C, "_create_graph_by_tracing", "traces a module into a TorchScript graph"),
    (_C, "_jit_trace_graph", "traces a function into a TorchScript graph"),
    (_C, "_jit_trace_module", "traces a module into a TorchScript graph"),
    (_C, "_freeze_module", "freezes a TorchScript module (torch.jit.freeze)"),
)


def shape_only_replacements() -> Iterator[tuple[object, str, object]]:
    """What a shape-only test's virtual device replaces: each way into TorchScript this torch
    has, refused."""
    for owner, name, what in _ENTRIES:
        original = getattr(owner, name, None)
        if original is not None:
            yield owner, name, _refuse(what, original)
