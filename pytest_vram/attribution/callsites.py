"""The user's frames of the running Python stack, found cheaply.

A frame is the user's when its file is not part of torch, pytest, pluggy, this plugin or
another installed library: a tensor a library call allocates is the user's line that called it.
"""

from __future__ import annotations

import os
import sys
import sysconfig
from types import FrameType

__all__ = ["Site", "format_site", "is_user_file", "user_frames"]

#: ``(filename, line, function)`` of one frame.
Site = tuple[str, int, str]

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _library_dirs() -> tuple[str, ...]:
    dirs = {_PACKAGE_DIR}
    for name in ("purelib", "platlib", "stdlib", "platstdlib"):
        path = sysconfig.get_paths().get(name)
        if path:
            dirs.add(os.path.realpath(path) + os.sep)
            dirs.add(os.path.abspath(path) + os.sep)
    torch = sys.modules.get("torch")
    if torch is not None:
        dirs.add(os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
    return tuple(sorted(dirs))


_MARKERS = (
    os.sep + "_pytest" + os.sep,
    os.sep + "pluggy" + os.sep,
    os.sep + "site-packages" + os.sep,
    os.sep + "dist-packages" + os.sep,
)
_LIBRARY_DIRS: tuple[str, ...] | None = None
# co_filename -> whether it is the user's: decided once per file.
_USER: dict[str, bool] = {}


def is_user_file(filename: str) -> bool:
    known = _USER.get(filename)
    if known is not None:
        return known
    global _LIBRARY_DIRS
    if _LIBRARY_DIRS is None:
        _LIBRARY_DIRS = _library_dirs()
    user = not (
        filename.startswith("<")
        or filename.startswith(_LIBRARY_DIRS)
        or os.path.abspath(filename).startswith(_LIBRARY_DIRS)
        or any(marker in filename for marker in _MARKERS)
    )
    _USER[filename] = user
    return user


def user_frames(limit: int = 3, start: FrameType | None = None) -> tuple[Site, ...]:
    """The innermost ``limit`` user frames below ``start`` (the caller), innermost first."""
    frame = start if start is not None else sys._getframe(1)
    found: list[Site] = []
    while frame is not None:
        code = frame.f_code
        if is_user_file(code.co_filename):
            found.append((code.co_filename, frame.f_lineno, code.co_name))
            if len(found) >= limit:
                break
        frame = frame.f_back
    return tuple(found)


def format_site(site: Site, root: str | None = None) -> str:
    """``file:line in function``, the file relative to ``root`` (the working directory)."""
    filename, line, name = site
    base = root or os.getcwd()
    try:
        rel = os.path.relpath(filename, base)
    except ValueError:  # another drive
        rel = filename
    if rel.startswith(".." + os.sep):
        rel = filename
    return f"{rel}:{line} in {name}"
