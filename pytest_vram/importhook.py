"""Acting on a module at the moment it is first imported."""

from __future__ import annotations

import importlib.abc
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["PatchOnImport"]


class PatchOnImport(importlib.abc.MetaPathFinder):
    """A finder that calls ``patch(module)`` right after the module ``name`` is first
    executed; ``install`` puts it first on ``sys.meta_path``, ``remove`` takes it off."""

    def __init__(self, name: str, patch: Callable[[Any], None]) -> None:
        self.name = name
        self.patch = patch

    def install(self) -> None:
        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname != self.name:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        execute = getattr(loader, "exec_module", None)
        if execute is None:
            return spec
        patch = self.patch

        def exec_module(module: Any) -> None:
            execute(module)
            patch(module)

        # On the loader this spec alone uses: the module keeps its own loader.
        loader.exec_module = exec_module  # type: ignore[union-attr]
        return spec
