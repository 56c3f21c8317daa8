"""Initialisers that read values, shape-only.

``nn.init.trunc_normal_`` draws and redraws until every value lies within its bounds: a loop on
``mask.any()``, which needs values. How many times a real run redraws is random, but the number
is sharply peaked: :func:`likely_redraws` gives the most likely one, and
:func:`trunc_normal_decided` runs torch's own ``trunc_normal_`` deciding its loop so, with the
allocations torch's code makes (each redraw's temporaries). The other place where shape-only
runs would allocate otherwise than a CUDA run, the autograd engine's gradient sums, is
:mod:`pytest_vram.backends.gradsums`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["likely_redraws", "trunc_normal_decided"]


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
