"""Where a shape-only test needed tensor values: the line of its own code, not the plugin's."""

from __future__ import annotations

from pathlib import Path

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException

import pytest_vram
from pytest_vram.backends.sim.backend import SimBackend

_ITEM = torch.ops.aten._local_scalar_dense.default


def _raised_in(path: Path) -> BaseException:
    """The needs-values error as the plugin's code at ``path`` would raise it in a test."""
    namespace: dict[str, object] = {}
    exec(compile("def call(exc):\n    raise exc\n", str(path), "exec"), namespace)
    try:
        namespace["call"](DataDependentOutputException(_ITEM))  # type: ignore[operator]
    except DataDependentOutputException as exc:
        return exc
    raise AssertionError("nothing raised")


def test_the_plugins_own_frames_are_not_the_tests_line() -> None:
    package = Path(pytest_vram.__file__).parent
    for module in ("wiring/session.py", "backends/base.py"):
        exc = _raised_in(package / module)
        message = SimBackend().explain_error(exc)
        assert message is not None
        line = exc.__traceback__.tb_lineno  # type: ignore[union-attr]
        assert f" at {__file__}:{line}." in message, module
        assert str(package / module) not in message
