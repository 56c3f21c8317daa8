"""One way to patch and put back: every patch of the simulated device goes through a PatchSet.

The virtual CUDA device and the simulated ranks replace attributes of torch's modules and
classes while a test runs. A :class:`PatchSet` records what each replacement hid, so that
:meth:`PatchSet.restore` puts back exactly what was there, object for object, last first, and
adds no names: an attribute a class only inherited is deleted again. Only what exists in the
torch version at hand is replaced.

A replacement of a function that TorchScript compiles as an operator (``torch.arange`` is
``aten::arange``) is made known to TorchScript as that operator, so that a function scripted
while the replacement is in place calls the operator, as it would without it: TorchScript
cannot compile the Python wrapper itself.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["PatchSet"]

_MISSING = object()
# What a class only inherited: restoring deletes the class's own attribute again.
_INHERITED = object()


# Per original (kept alive here, so that its id stays its own): the TorchScript operator it
# is, or None. Every test installs the same replacements: looking each up again cost a tenth
# of a small test's time.
_OPERATORS: dict[int, tuple[object, Any]] = {}


def _same_builtin(value: object, original: object) -> None:
    """Make ``value`` the TorchScript operator that ``original`` is, if it is one."""
    if value is original or not callable(original):
        return
    known = _OPERATORS.get(id(original))
    if known is None or known[0] is not original:
        from torch.jit import _builtins

        known = _OPERATORS[id(original)] = (original, _builtins._find_builtin(original))
    op = known[1]
    if op is not None:
        from torch.jit import _builtins

        # Kept for the session: each replacement is made once and lives as long.
        _builtins._register_builtin(value, op)


class PatchSet:
    """The replacements made so far, each with what it replaced.

    Each replacement is recorded before it is made, so that a failure part way leaves a set
    that :meth:`restore` undoes; restoring twice is restoring once.
    """

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    def __len__(self) -> int:
        return len(self._saved)

    def replace(self, owner: object, name: str, value: object) -> None:
        """Set ``name`` on ``owner`` where it has it (a class: in the class itself)."""
        if isinstance(owner, type):
            original = owner.__dict__.get(name, _MISSING)
        else:
            original = getattr(owner, name, _MISSING)
        if original is _MISSING:
            return
        self._saved.append((owner, name, original))
        setattr(owner, name, value)
        _same_builtin(value, original)

    def shadow(self, owner: object, name: str, value: object) -> None:
        """Set ``name`` on ``owner`` where it has it, inherited included."""
        if isinstance(owner, type) and name not in owner.__dict__:
            if not hasattr(owner, name):
                return
            self._saved.append((owner, name, _INHERITED))
            setattr(owner, name, value)
        else:
            self.replace(owner, name, value)

    def replace_all(self, replacements: Iterable[tuple[object, str, object]]) -> None:
        """:meth:`replace` each ``(owner, name, value)``, in order."""
        for owner, name, value in replacements:
            self.replace(owner, name, value)

    def restore(self) -> None:
        """Put everything back, the last replacement first. One that cannot be put back does
        not keep the others from it; the first such error is raised at the end."""
        error: BaseException | None = None
        saved = self._saved
        while saved:
            owner, name, original = saved.pop()
            try:
                if original is _INHERITED:
                    delattr(owner, name)
                else:
                    setattr(owner, name, original)
            except Exception as exc:  # the others still get their turn
                error = error or exc
        if error is not None:
            raise error

    def __enter__(self) -> PatchSet:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.restore()
