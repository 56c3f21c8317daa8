"""A measured test's own resets of torch.cuda's memory statistics.

While a test is measured on cuda, ``torch.cuda.reset_peak_memory_stats`` and its kin
(``reset_max_memory_allocated``, ``reset_max_memory_cached``,
``reset_accumulated_memory_stats``, under ``torch.cuda``, ``torch.cuda.memory`` and
``torch.accelerator``) first tell the backend, which keeps what the reset would take from its
figures, and then run torch's reset: the test's own code reads what torch answers after a
reset, the plugin still sees the spike before it. The backend's own resets call torch's
functions as they were (:func:`unwrapped`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["ACCUMULATED", "ResetWrappers", "unwrapped"]

#: The reset of the counters that only grow (out-of-memory errors, retries); the others
#: reset peaks.
ACCUMULATED = "reset_accumulated_memory_stats"
_NAMES = (
    "reset_peak_memory_stats",
    "reset_max_memory_allocated",
    "reset_max_memory_cached",
    ACCUMULATED,
)
_ORIGINAL = "__pytest_vram_unwrapped__"


def unwrapped(function: Callable[..., Any]) -> Callable[..., Any]:
    """torch's function behind a wrapper of this module, or ``function`` itself."""
    return getattr(function, _ORIGINAL, function)


def _owners() -> list[object]:
    accelerator = getattr(torch, "accelerator", None)
    owners: list[object] = [torch.cuda, torch.cuda.memory]
    if accelerator is not None:
        owners += [accelerator, getattr(accelerator, "memory", None)]
    return [owner for owner in owners if owner is not None]


class ResetWrappers:
    """Wraps the reset functions while a test is measured; ``before(name, device)`` runs
    before each call of torch's own (``device`` as the caller gave it, None for the current
    one)."""

    def __init__(self, before: Callable[[str, Any], None]) -> None:
        self._before = before
        #: ``(owner, name, wrapper, original)`` for each function wrapped now.
        self._installed: list[tuple[object, str, Any, Any]] = []

    def install(self) -> None:
        if self._installed:
            return
        for owner in _owners():
            for name in _NAMES:
                original = owner.__dict__.get(name)
                if original is None or not callable(original):
                    continue
                wrapper = self._wrap(name, unwrapped(original))
                setattr(owner, name, wrapper)
                self._installed.append((owner, name, wrapper, original))

    def uninstall(self) -> None:
        installed, self._installed = self._installed, []
        for owner, name, wrapper, original in reversed(installed):
            # Put back only our own: whatever replaced it since (a test's mock) stays its own.
            if owner.__dict__.get(name) is wrapper:
                setattr(owner, name, original)

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        before = self._before

        @functools.wraps(original)
        def reset(*args: Any, **kwargs: Any) -> Any:
            # torch.accelerator names its argument device_index.
            before(name, args[0] if args else kwargs.get("device", kwargs.get("device_index")))
            return original(*args, **kwargs)

        setattr(reset, _ORIGINAL, original)
        return reset
