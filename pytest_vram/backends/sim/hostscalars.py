"""An optimizer's own host tensors (AdamW's ``step`` counters): host memory, not the device's.

For CUDA parameters that are neither ``capturable`` nor ``fused``, torch keeps such tensors on
the host: made inside ``step`` with no device or the CPU, while the default device is not CUDA.
On the simulated device every CPU tensor would count, so the factories that make them
(:data:`HOST_FACTORIES`) ask :meth:`HostScalars.made_by` first. Which optimizer is stepping
comes from torch's global optimizer step hooks, as attribution learns it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.optim import optimizer as torch_optimizer

from pytest_vram.backends.sim.cudaremap import is_cuda_device

__all__ = ["HOST_FACTORIES", "HostScalars"]

#: The factories an optimizer makes its host scalars with.
HOST_FACTORIES = frozenset(
    {torch.tensor, torch.as_tensor, torch.scalar_tensor, torch.zeros, torch.ones, torch.full,
     torch.empty}
)  # fmt: skip
# The originals: computing, the names in torch may be replaced by wrappers (cudaremap).
_COPYING_FACTORIES = (torch.tensor, torch.as_tensor)


class _Stepping(threading.local):
    def __init__(self) -> None:
        #: The optimizers whose ``step`` runs on this thread, innermost last.
        self.optimizers: list[Any] = []


class HostScalars:
    """Tells a factory call that makes an optimizer's host scalar, between :meth:`start`
    and :meth:`stop` (while a simulated test runs)."""

    def __init__(self) -> None:
        self._stepping = _Stepping()
        self._handles: list[Any] = []

    def start(self) -> None:
        if self._handles:
            return
        self._handles = [
            torch_optimizer.register_optimizer_step_pre_hook(self._step_starts),
            torch_optimizer.register_optimizer_step_post_hook(self._step_ends),
        ]

    def stop(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()
        self._stepping.optimizers.clear()

    def _step_starts(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        stepping = self._stepping.optimizers
        # A step that raised ran no post hook: the optimizer's stale entry (and any above it)
        # ends here.
        _drop_from(stepping, optimizer)
        stepping.append(optimizer)

    def _step_ends(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        _drop_from(self._stepping.optimizers, optimizer)

    def stepping_optimizer(self) -> Any:
        """The optimizer whose ``step`` runs on this thread, if one does."""
        stepping = self._stepping.optimizers
        return stepping[-1] if stepping else None

    def made_by(self, func: Callable, args: tuple, kwargs: dict | None) -> bool:
        """Whether ``func(*args, **kwargs)`` makes one of an optimizer's own host tensors.

        Capturable and fused optimizers put them on the parameters' device, which is ``cpu``
        on the simulated device too, so their factories are left alone.
        """
        optimizer = self.stepping_optimizer()
        if optimizer is None:  # nearly every call: first, as it is the cheapest
            return False
        device = kwargs.get("device") if kwargs else None
        if device is not None and is_cuda_device(device):
            return False
        if func in _COPYING_FACTORIES and args and isinstance(args[0], torch.Tensor):
            return False
        if torch.get_default_device().type == "cuda":
            return False
        groups = getattr(optimizer, "param_groups", None)
        if not isinstance(groups, list):
            return False
        return not any(group.get("capturable") or group.get("fused") for group in groups)


def _drop_from(stepping: list[Any], optimizer: Any) -> None:
    for index in range(len(stepping) - 1, -1, -1):
        if stepping[index] is optimizer:
            del stepping[index:]
            return
