"""CUDA's autocast on the simulated device, whose tensors are CPU tensors.

``torch.autocast("cuda", dtype)`` runs as CPU autocast (:func:`autocast_init`), and the
functions a test calls directly follow CUDA's op lists where they differ from the CPU's
(:func:`cuda_autocast_policies`, applied by :func:`autocast_call`): ``softmax``, ``sum``,
``exp``, norms and losses in float32; ``einsum`` and friends in the low precision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

__all__ = [
    "autocast_call",
    "autocast_init",
    "cuda_autocast_policies",
    "cuda_query_as_cpu",
    "real_get_autocast_dtype",
    "real_is_autocast_enabled",
]

# The real answers, read before anything is patched.
real_is_autocast_enabled = torch.is_autocast_enabled
real_get_autocast_dtype = torch.get_autocast_dtype

_FP32, _FP32_DTYPE, _LOWER, _PROMOTE = "fp32", "fp32 dtype", "lower", "promote"


def cuda_autocast_policies() -> dict[Callable, str]:
    """CUDA autocast's op lists (ATen's autocast_mode.cpp) where they differ from the CPU's."""
    F = nn.functional
    T = torch.Tensor
    linalg = torch.linalg
    table: dict[Callable, str] = {}

    def add(policy: str, *funcs: Callable | None) -> None:
        for func in funcs:
            if func is not None:
                table[func] = policy

    def both(*names: str) -> list[Callable | None]:
        return [f for name in names for f in (getattr(torch, name, None), getattr(T, name, None))]

    add(
        _FP32,
        *both(
            "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
            "reciprocal", "rsqrt", "sinh", "tan", "pow", "norm", "dist", "renorm", "logsumexp",
            "cosine_similarity", "cdist", "layer_norm", "group_norm", "rms_norm",
        ),
        T.__pow__, T.__rpow__,
        F.softplus, F.layer_norm, F.group_norm, getattr(F, "rms_norm", None),
        F.cosine_similarity, F.poisson_nll_loss, F.cosine_embedding_loss, F.nll_loss,
        F.hinge_embedding_loss, F.kl_div, F.l1_loss, F.smooth_l1_loss, F.huber_loss, F.mse_loss,
        F.margin_ranking_loss, F.multilabel_margin_loss, F.soft_margin_loss,
        F.triplet_margin_loss, F.multi_margin_loss, F.binary_cross_entropy_with_logits,
        F.pdist, F.interpolate, F.upsample, F.upsample_nearest, F.upsample_bilinear,
    )  # fmt: skip
    add(
        _FP32_DTYPE,
        *both("softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum"),
        F.softmax, F.log_softmax, linalg.vector_norm, linalg.matrix_norm,
    )  # fmt: skip
    add(
        _LOWER,
        *both("addmv", "addr", "mv", "chain_matmul"),
        torch.einsum, linalg.multi_dot, linalg.vecdot,
    )  # fmt: skip
    add(
        _PROMOTE,
        *both("addcdiv", "addcmul", "atan2", "cross", "dot", "vdot", "index_put", "tensordot",
              "scatter_add"),
        F.bilinear,
    )  # fmt: skip
    return table


def _map_tensors(value: Any, cast: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(value, torch.Tensor):
        return cast(value)
    if isinstance(value, (list, tuple)) and any(isinstance(v, torch.Tensor) for v in value):
        return type(value)(cast(v) if isinstance(v, torch.Tensor) else v for v in value)
    return value


def _tensors(args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _eligible(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() and tensor.dtype != torch.float64


def autocast_call(policy: str, func: Callable, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` with its tensors cast as ``policy`` (of
    :func:`cuda_autocast_policies`) says CUDA's autocast would."""
    if policy == _FP32_DTYPE:
        first = next(_tensors(args, kwargs), None)
        has_dtype = kwargs.get("dtype") is not None or any(isinstance(a, torch.dtype) for a in args)
        if first is not None and _eligible(first) and not has_dtype:
            kwargs["dtype"] = torch.float32
        return func(*args, **kwargs)
    if policy == _FP32:
        target = torch.float32
        wanted = {torch.float16, torch.bfloat16}
    elif policy == _LOWER:
        target = real_get_autocast_dtype("cpu")
        wanted = {torch.float32, torch.float16, torch.bfloat16} - {target}
    else:
        dtypes = {t.dtype for t in _tensors(args, kwargs) if _eligible(t)}
        if torch.float32 not in dtypes or len(dtypes) < 2:
            return func(*args, **kwargs)
        target = torch.float32
        wanted = {torch.float16, torch.bfloat16}

    def cast(tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(target) if tensor.dtype in wanted else tensor

    args = tuple(_map_tensors(a, cast) for a in args)
    kwargs = {k: _map_tensors(v, cast) for k, v in kwargs.items()}
    return func(*args, **kwargs)


def autocast_init(original: Callable) -> Callable:
    """``autocast.__init__`` that makes a CUDA autocast a CPU one, in CUDA's default dtype."""

    def __init__(
        self: Any,
        device_type: str,
        dtype: torch.dtype | None = None,
        enabled: bool = True,
        cache_enabled: bool | None = None,
    ) -> None:
        # Computing without the function mode, a CUDA autocast enters it (cudaremap).
        self._pytest_vram_cuda = isinstance(device_type, str) and device_type == "cuda"
        if self._pytest_vram_cuda:
            # CUDA's default low precision is float16, the CPU's bfloat16.
            dtype = real_get_autocast_dtype("cuda") if dtype is None else dtype
            device_type = "cpu"
        original(self, device_type, dtype=dtype, enabled=enabled, cache_enabled=cache_enabled)

    return __init__


def cuda_query_as_cpu(original: Callable) -> Callable:
    """An autocast query (``torch.is_autocast_enabled``) that answers for ``cuda`` from the
    CPU, where the simulated device's autocast runs."""

    def query(device_type: str | None = None, *args: Any) -> Any:
        if device_type is None or device_type == "cuda":
            device_type = "cpu"
        return original(device_type, *args)

    return query
