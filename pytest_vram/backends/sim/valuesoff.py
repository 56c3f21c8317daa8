"""What a shape-only test that reads a tensor's value is told when values on demand are off
(``--vram-sim-compute=never``): one line that names the user's line and the ways out.

Imported by the session at plugin load, so it imports torch only when it runs.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

__all__ = ["needs_values_message"]


def needs_values_message(exc: BaseException, rootpath: os.PathLike[str] | str) -> str | None:
    """The one error of a shape-only test that read a tensor's value and is not run again
    computing; None when ``exc`` is not for want of values."""
    from pytest_vram.backends.sim.backend import needs_values_error

    cause = needs_values_error(exc)
    if cause is None:
        return None
    where = _user_line(exc, rootpath) or _user_line(cause, rootpath) or "the test"
    func = getattr(cause, "func", None)
    return (
        f"{where}: reads a tensor's value ({func}), which the simulated device does not "
        "compute shape-only, and values on demand are off (--vram-sim-compute=never); run with "
        "--vram-sim-compute=always to compute this test's values on the CPU (or auto: only "
        "where a test needs them)"
    )


# pytest_vram/, three folders up from backends/sim/valuesoff.py.
_PACKAGE_FOLDER = str(Path(__file__).resolve().parents[2]) + os.sep


def _not_users() -> tuple[str, ...]:
    """The folders of the frames that are not the user's: torch, pytest, pluggy, the standard
    library and this package."""
    import _pytest
    import pluggy
    import torch

    modules = (torch, pytest, _pytest, pluggy, contextlib)
    folders = tuple(
        os.path.dirname(os.path.abspath(module.__file__)) + os.sep
        for module in modules
        if module.__file__
    )
    return (*folders, _PACKAGE_FOLDER)


def _user_line(exc: BaseException, rootpath: os.PathLike[str] | str) -> str | None:
    """``file:line`` of the innermost frame of ``exc``'s traceback in the user's code."""
    not_users = _not_users()
    found = None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not filename.startswith((*not_users, "<")):
            found = (filename, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return None
    filename, line = found
    with contextlib.suppress(ValueError):  # on another drive: the whole path
        filename = os.path.relpath(filename, rootpath)
    return f"{filename}:{line}"
