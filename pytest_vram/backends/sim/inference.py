"""Composite ops under ``torch.inference_mode()``, run as their parts as on a GPU.

An op such as ``matmul``, ``einsum`` or ``linear`` has no CUDA kernel of its own: it is a
CompositeImplicitAutograd op, which a GPU runs as the ops it is made of (``mm``, ``bmm``,
``reshape``, ``clone``...), each allocating through the caching allocator, and the first
matrix product making a cuBLAS workspace. In grad mode and under ``torch.no_grad()`` the
autograd key breaks such an op up before it reaches the simulated device's fake mode. Under
``torch.inference_mode()`` autograd is skipped, so the op reaches the fake mode whole, whose own
decomposition of it is not counted: the simulated device would see one output where the GPU
makes each part's. :func:`runs_as_its_parts` tells which ops the fake mode breaks up itself,
at the top level and only under inference mode.
"""

from __future__ import annotations

import functools

import torch
from torch._ops import OpOverload

__all__ = ["runs_as_its_parts"]

_HAS_KERNEL = torch._C._dispatch_has_kernel_for_dispatch_key
# A kernel under one of these keys runs for a CUDA tensor in place of the composite one.
_OWN_KERNELS = ("CUDA", "CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional")


@functools.cache
def runs_as_its_parts(func: OpOverload) -> bool:
    """Whether a GPU runs ``func`` as the ops its CompositeImplicitAutograd kernel calls."""
    name = func.name()
    if not _HAS_KERNEL(name, "CompositeImplicitAutograd"):
        return False
    return not any(_HAS_KERNEL(name, key) for key in _OWN_KERNELS)
