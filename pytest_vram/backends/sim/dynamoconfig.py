"""Making a ``FakeTensorMode`` without importing ``torch._dynamo``.

``FakeTensorMode.__init__`` reads two flags from ``torch._dynamo.config``, and importing that
module imports the whole of ``torch._dynamo`` first (its package), which takes from under a
second to three (with a cold disk) and which a run that never compiles does not otherwise pay.
:func:`load_config_alone` loads the config module by itself, under its own name, and leaves
``torch._dynamo`` to be imported by the first code that uses anything else of it: that import
then finds the same config module, so there is still one configuration.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

import torch

__all__ = ["load_config_alone"]

_PACKAGE = "torch._dynamo"
_CONFIG = _PACKAGE + ".config"


class _NotYetImported(types.ModuleType):
    """``torch._dynamo`` before its import: has ``config``; anything else imports it."""

    def __getattr__(self, name: str) -> Any:
        return getattr(importlib.import_module(_PACKAGE), name)


def load_config_alone() -> bool:
    """Load ``torch._dynamo.config`` without ``torch._dynamo``, unless either is loaded;
    whether it was. Anything unexpected leaves the import system as it was."""
    if _PACKAGE in sys.modules or _CONFIG in sys.modules or "_dynamo" in vars(torch):
        return False
    folder = os.path.join(os.path.dirname(torch.__file__), "_dynamo")
    spec = importlib.machinery.PathFinder.find_spec(_CONFIG, [folder])
    if spec is None or spec.loader is None:
        return False
    config = importlib.util.module_from_spec(spec)
    sys.modules[_CONFIG] = config
    try:
        spec.loader.exec_module(config)
    except Exception:
        del sys.modules[_CONFIG]
        return False
    package = _NotYetImported(_PACKAGE)
    package.config = config  # type: ignore[attr-defined]
    # What ``torch._dynamo.config`` reads until the real package replaces it (an import sets
    # the attribute on its parent).
    torch._dynamo = package  # type: ignore[attr-defined]
    return True
