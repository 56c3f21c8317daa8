"""Why a shape-only test failed when it needed tensor values, and where.

Shape-only, the simulated device's tensors are fake: an op that needs values (``.item()``, a
Python branch on a tensor, an output whose shape depends on values) raises FakeTensorMode's
error. :func:`needs_values_error` finds it in an exception's chain (values on demand then runs
the test again computing); :func:`explain_needs_values` says what the test needed, at the line
of the test's own code, and the ways out.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
)

__all__ = ["explain_needs_values", "needs_values_error"]

_NEEDS_VALUES = (DataDependentOutputException, DynamicOutputShapeException)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
# pytest_vram/, whose frames are not the test's own.
_PACKAGE_DIR = str(Path(os.path.abspath(__file__)).parents[2]) + os.sep
_FRAMEWORK_MARKERS = (
    os.sep + "_pytest" + os.sep,
    os.sep + "pluggy" + os.sep,
    os.sep + "contextlib.py",
)


def needs_values_error(exc: BaseException | None) -> BaseException | None:
    """The FakeTensorMode error in ``exc``'s chain that says an op needed tensor values."""
    pending = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, _NEEDS_VALUES):
            return current
        pending.extend((current.__context__, current.__cause__))
    return None


def _user_location(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``exc``'s traceback in the test's own code."""
    location = None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not (
            filename.startswith((_TORCH_DIR, _PACKAGE_DIR))
            or any(marker in filename for marker in _FRAMEWORK_MARKERS)
        ):
            location = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return location


def explain_needs_values(exc: BaseException) -> str | None:
    """What a shape-only test that failed with ``exc`` needed, where, and the ways out; None
    when no op in ``exc``'s chain needed values."""
    cause = needs_values_error(exc)
    if cause is None:
        return None
    func = getattr(cause, "func", None)
    if isinstance(cause, DynamicOutputShapeException):
        what = f"an op whose output shape depends on tensor values ({func})"
    else:
        what = (
            f"a tensor's value ({func}: .item(), .tolist(), bool(tensor) or a Python branch "
            "on a tensor)"
        )
    location = _user_location(exc) or _user_location(cause)
    where = f" at {location}" if location else ""
    return (
        f"the simulated device computes no values, and this test needs {what}{where}. "
        "Shape-only, the sim backend's tensors are fake: they carry shapes, dtypes and "
        "memory but no data. With --vram-sim-compute=auto (the default) such a test runs "
        "again computing its values on the CPU, with the same figures; or run it on a "
        'device that computes, with @pytest.mark.vram_backend("cpu") (or "cuda" on a GPU '
        "runner)."
    )
