"""Where shape-only runs of PyTorch code would allocate otherwise than a CUDA run does.

Shape-only, the simulated device runs code on fake tensors, and two things then take another
path than on a GPU:

- **The autograd engine's gradient sums.** When a tensor's gradient arrives from two places (a
  residual stream, tied embeddings, a tensor used twice), the engine adds the second into the
  first in place (``old.add_(new)``, ``InputBuffer::accumulate`` in
  ``torch/csrc/autograd/input_buffer.cpp``) when it holds the only reference to a dense
  tensor and its storage, which is the case in a CUDA run; for any tensor subclass, a fake
  tensor included, and for a storage that a counting record keeps a second reference to (the
  tracker's, computing), it adds out of place, a new buffer the size of the gradient each
  time. :func:`accumulates_in_place` tells the engine's sums apart, and the simulated device
  runs them in place, as CUDA does.
- **Initialisers that read values.** ``nn.init.trunc_normal_`` draws and redraws until every
  value lies within its bounds: a loop on ``mask.any()``, which needs values. How many times a
  real run redraws is random, but the number is sharply peaked: :func:`likely_redraws` gives
  the most likely one, and :func:`trunc_normal_decided` runs torch's own ``trunc_normal_``
  deciding its loop so, with the allocations torch's code makes (each redraw's temporaries).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["accumulates_in_place", "likely_redraws", "trunc_normal_decided"]

_ADD = torch.ops.aten.add.Tensor
# The Python frame the autograd engine runs in (backward() and autograd.grad()): an op whose
# caller is this frame comes from the engine's C++ (a derivative formula or a gradient sum),
# not from Python code in a backward (a custom Function's, a hook).
_ENGINE_CODE = torch.autograd.graph._engine_run_backward.__code__


def accumulates_in_place(func: Any, args: tuple, kwargs: dict | None, caller: Any) -> bool:
    """Whether ``func(*args)``, called from the frame ``caller``, is the autograd engine
    summing two gradients that a CUDA run sums in place, into ``args[0]``.

    As the engine decides for a tensor nothing else holds: grad mode off (no
    ``create_graph``), the first gradient a dense tensor that owns its storage and is
    referenced no more than the second (the engine's buffer holds the only reference; a
    gradient handed to two inputs at once is referenced twice), both of the same shape, dtype
    and device, and of one kind (fake, or real).
    """
    if func is not _ADD or len(args) != 2 or kwargs or torch.is_grad_enabled():
        return False
    if caller is None or caller.f_code is not _ENGINE_CODE:
        return False
    old, new = args
    if not isinstance(old, torch.Tensor) or type(old) is not type(new) or old is new:
        return False
    if old.shape != new.shape or old.dtype != new.dtype or old.device != new.device:
        return False
    try:
        whole = (
            old.storage_offset() == 0
            and old.untyped_storage().nbytes() == old.numel() * old.element_size()
        )
    except (NotImplementedError, RuntimeError):
        return False
    return (
        whole
        and is_non_overlapping_and_dense_or_false(old)
        and old._use_count() <= new._use_count()
    )


# -- trunc_normal_ -----------------------------------------------------------------------------


def _normal_cdf(x: float) -> float:
    return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0


def _rejected(mean: float, std: float, a: float, b: float) -> float:
    """The chance that one draw of torch's ``trunc_normal_`` is rejected (redrawn)."""
    inside = _normal_cdf((b - mean) / std) - _normal_cdf((a - mean) / std)
    if inside > 0.3:
        return 1.0 - inside  # a normal draw outside [a, b]
    # Rejection sampling from a uniform draw on [a, b] under the density's peak at `mode`.
    mode = max(a, min(mean, b))
    peak = math.exp(-0.5 * ((mode - mean) / std) ** 2)
    accepted = inside * std * math.sqrt(2.0 * math.pi) / ((b - a) * peak)
    return min(max(1.0 - accepted, 0.0), 1.0)


def likely_redraws(numel: int, mean: float, std: float, a: float, b: float) -> int:
    """The most likely number of times torch's ``trunc_normal_`` redraws ``numel`` values.

    An element is still rejected after ``k`` redraws with chance ``q ** (k + 1)``, so the run
    redraws at most ``k`` times with chance ``(1 - q ** (k + 1)) ** numel``: the answer is the
    smallest ``k`` for which that is at least even (for a million values within 3 standard
    deviations: 2, in 98% of real runs).
    """
    if numel <= 0 or not std > 0 or not a < b:
        return 0
    rejected = _rejected(mean, std, a, b)
    if rejected <= 0.0:
        return 0
    if rejected >= 1.0:
        return 64
    half = math.log(0.5)
    for redraws in range(64):
        if numel * math.log1p(-(rejected ** (redraws + 1))) >= half:
            return redraws
    return 64


def _bound(args: tuple, kwargs: dict, position: int, name: str, default: float) -> float:
    value = args[position] if len(args) > position else kwargs.get(name, default)
    return float(value)


def trunc_normal_decided(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``original`` (torch's ``_no_grad_trunc_normal_``), whose loop, on a fake tensor, redraws
    :func:`likely_redraws` times: the checks that would need values answer True that often,
    then False. Values that are known (bounds far enough out) still decide by themselves."""

    @functools.wraps(original)
    def trunc_normal(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        known = getattr(getattr(tensor, "fake_mode", None), "known", None)
        if not isinstance(tensor, FakeTensor) or known is None:
            return original(tensor, *args, **kwargs)
        mean = _bound(args, kwargs, 0, "mean", 0.0)
        std = _bound(args, kwargs, 1, "std", 1.0)
        a = _bound(args, kwargs, 2, "a", -2.0)
        b = _bound(args, kwargs, 3, "b", 2.0)
        redraws = likely_redraws(tensor.numel(), mean, std, a, b)
        with known.deciding([True] * redraws + [False]):
            return original(tensor, *args, **kwargs)

    return trunc_normal
