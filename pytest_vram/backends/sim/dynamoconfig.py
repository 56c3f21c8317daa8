"""Making a ``FakeTensorMode`` without importing ``torch._dynamo``.

``FakeTensorMode.__init__`` reads two flags from ``torch._dynamo.config``, and importing that
module imports the whole of ``torch._dynamo`` first (its package), which takes from under a
second to three (with a cold disk) and which a run that never compiles does not otherwise pay.
:func:`load_config_alone` loads the config module by itself, under its own name, and leaves
``torch._dynamo`` to be imported by the first code that uses anything else of it: that import
then finds the same config module, so there is still one configuration, and the package has it
as its ``config`` attribute from the start (an import of a module already in ``sys.modules``
does not set it on its parent, and torch 2.6's package binds it no other way).

Many of the Python kernels FakeTensorMode runs (the decompositions behind elementwise ops) are
wrapped by ``torch._disable_dynamo``, which imports ``torch._dynamo`` at their first call to
ask it for a disabled version of the function: a second of CPU time for the first shape-only
test of a run. :func:`defer_disabled_functions` gives each such function a stand-in for that
disabled version, which calls the function itself while ``torch._dynamo`` is not imported
(nothing can be compiling then) and, once it is, hands over to torch's own.
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
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["defer_disabled_functions", "load_config_alone"]

_PACKAGE = "torch._dynamo"
_CONFIG = _PACKAGE + ".config"
# Where torch._disable_dynamo keeps a function's disabled version (no name mangling: it is set
# in a module-level function).
_DISABLED = "__dynamo_disable"
#: The functions given a stand-in (defer_disabled_functions), each with it.
_STOOD_IN: list[tuple[Any, Any]] = []


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
        # Dynamo would trace a stand-in as user code (a compiled frame meets torch's wrapper):
        # from now on each wrapper asks Dynamo itself.
        _drop_stand_ins()
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
    defer_disabled_functions()
    return True


def defer_disabled_functions() -> int:
    """Give each function ``torch._disable_dynamo`` wrapped, and that has not yet asked
    ``torch._dynamo`` for its disabled version, a stand-in for it; how many got one."""
    wrapper = getattr(getattr(torch, "_compile", None), "_disable_dynamo", None)
    if wrapper is None or _PACKAGE in sys.modules:
        return 0
    try:
        code = wrapper(_nothing).__code__
    except Exception:  # another torch
        return 0
    if code.co_freevars[:1] != ("fn",):
        return 0
    deferred = 0
    for inner in _functions_of_torch():
        if inner.__code__ is code:
            fn = inner.__closure__[0].cell_contents  # type: ignore[index]
            if getattr(fn, _DISABLED, None) is None:
                with contextlib.suppress(AttributeError, TypeError):
                    stand_in = _until_dynamo(fn, inner)
                    setattr(fn, _DISABLED, stand_in)
                    _STOOD_IN.append((fn, stand_in))
                    deferred += 1
    return deferred


def _drop_stand_ins() -> None:
    """Take each stand-in off its function again, where it still is there."""
    while _STOOD_IN:
        fn, stand_in = _STOOD_IN.pop()
        if getattr(fn, _DISABLED, None) is stand_in:
            with contextlib.suppress(AttributeError):
                delattr(fn, _DISABLED)


def _nothing() -> None:
    pass


def _functions_of_torch() -> Iterator[types.FunctionType]:
    """The functions torch's loaded modules hold, and those they wrap (``__wrapped__``, or in
    their closures, as decorators leave them): where the decompositions and their wrappers
    are. (Not ``gc.get_objects()``: the session freezes what exists before the tests, out of
    its sight.)"""
    function = types.FunctionType
    seen: set[int] = set()
    pending: list[Any] = []
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "torch" or name.startswith("torch.")):
            continue
        try:
            pending.extend(vars(module).values())
        except TypeError:
            continue
        while pending:
            value = pending.pop()
            if type(value) is not function or id(value) in seen:
                continue
            seen.add(id(value))
            yield value
            pending.append(value.__dict__.get("__wrapped__"))
            for cell in value.__closure__ or ():
                with contextlib.suppress(ValueError):  # an empty cell
                    pending.append(cell.cell_contents)


def _until_dynamo(fn: Any, inner: Any) -> Any:
    """What ``inner`` (torch._disable_dynamo's wrapper of ``fn``) calls instead of ``fn``'s
    disabled version: ``fn`` itself while ``torch._dynamo`` is not imported; torch's own
    disabled version from then on."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if getattr(sys.modules.get(_PACKAGE), "disable", None) is None:
            return fn(*args, **kwargs)
        # Imported: torch's wrapper makes and keeps the real one.
        with contextlib.suppress(AttributeError):
            delattr(fn, _DISABLED)
        return inner(*args, **kwargs)

    return call
