"""Making a ``FakeTensorMode`` without importing ``torch._dynamo``.

``FakeTensorMode.__init__`` reads two flags from ``torch._dynamo.config``, and importing that
module imports the whole of ``torch._dynamo`` first (its package), which takes from under a
second to three (with a cold disk) and which a run that never compiles does not otherwise pay.
:func:`load_config_alone` loads the config module by itself, under its own name, and leaves
``torch._dynamo`` to be imported by the first code that uses anything else of it: that import
then finds the same config module, so there is still one configuration, and the package has it
as its ``config`` attribute from the start (an import of a module already in ``sys.modules``
does not set it on its parent, and torch 2.6's package binds it no other way).
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
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


class _PackageLoader(importlib.machinery.SourceFileLoader):
    """Runs ``torch._dynamo``'s ``__init__`` with ``config`` already bound in it, as it would
    be had the package's own import loaded the config module."""

    def __init__(self, name: str, path: str, config: types.ModuleType, finder: _PackageFinder):
        super().__init__(name, path)
        self.config = config
        self.finder = finder

    def exec_module(self, module: types.ModuleType) -> None:
        if sys.modules.get(_CONFIG) is self.config:
            module.config = self.config  # type: ignore[attr-defined]
        super().exec_module(module)
        # Loaded: later imports find it in sys.modules and need the finder no more.
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self.finder)


class _PackageFinder(importlib.abc.MetaPathFinder):
    """Finds ``torch._dynamo`` where the path finder does, with :class:`_PackageLoader`."""

    def __init__(self, config: types.ModuleType):
        self.config = config

    def find_spec(
        self, fullname: str, path: Any = None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != _PACKAGE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and type(spec.loader) is importlib.machinery.SourceFileLoader:
            loader = spec.loader
            spec.loader = _PackageLoader(loader.name, loader.path, self.config, self)
        return spec


def load_config_alone() -> bool:
    """Load ``torch._dynamo.config`` without ``torch._dynamo``, unless either is loaded;
    whether it was. Anything unexpected leaves the import system as it was."""
    if _PACKAGE in sys.modules or _CONFIG in sys.modules or "_dynamo" in vars(torch):
        return False
    package_spec = importlib.machinery.PathFinder.find_spec(_PACKAGE, list(torch.__path__))
    # Only a package of source files is loaded with the config bound in it.
    if (
        package_spec is None
        or type(package_spec.loader) is not importlib.machinery.SourceFileLoader
    ):
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
    sys.meta_path.insert(0, _PackageFinder(config))
    package = _NotYetImported(_PACKAGE)
    package.config = config  # type: ignore[attr-defined]
    # What ``torch._dynamo.config`` reads until the real package replaces it (an import sets
    # the attribute on its parent).
    torch._dynamo = package  # type: ignore[attr-defined]
    return True
