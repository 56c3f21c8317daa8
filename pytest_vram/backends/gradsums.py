"""The autograd engine's gradient sums, which a CUDA run makes in place.

When a tensor's gradient arrives from two places (a residual stream, tied embeddings, a tensor
used twice), the engine adds the second into the first in place (``old.add_(new)``,
``InputBuffer::accumulate`` in ``torch/csrc/autograd/input_buffer.cpp``) when it holds the only
reference to a dense tensor and its storage, which is the case in a CUDA run unless the first
gradient is a view (a linear layer's or an einsum's input gradient), whose base holds the
storage too; for any tensor
subclass, a fake tensor included, and for a storage that a counting record keeps a second
reference to (the tracker's), it adds out of place, a new buffer the size of the gradient each
time. :func:`accumulates_in_place` tells the engine's sums apart, so that the counting modes
(the tracker's and the simulated device's) run them in place, as CUDA does.

Several derivative formulas (``torch/csrc/autograd/FunctionsManual.cpp``) fill a fresh tensor
of zeros by a scatter, an index_put, an index_add or a put, in place for plain tensors and out
of place, a second buffer the size of the input, for tensor subclasses or while a dispatch mode
is active: ``max(dim)``'s and ``sort``'s backward, indexing's, ``gather``'s, and others.
:func:`scattered_in_place` gives the in-place op a CUDA run makes there.
"""

from __future__ import annotations

from typing import Any

import torch

try:
    from torch._prims_common import is_non_overlapping_and_dense_or_false
except ImportError:  # torch before 2.7, whose sizes here are never symbolic
    from torch._prims_common import (
        is_non_overlapping_and_dense as is_non_overlapping_and_dense_or_false,
    )

__all__ = ["IN_PLACE_SCATTERS", "accumulates_in_place", "scattered_in_place"]

_ADD = torch.ops.aten.add.Tensor
# The Python frame the autograd engine runs in (backward() and autograd.grad()): an op whose
# caller is this frame comes from the engine's C++ (a derivative formula or a gradient sum),
# not from Python code in a backward (a custom Function's, a hook).
_ENGINE_CODE = torch.autograd.graph._engine_run_backward.__code__


def accumulates_in_place(func: Any, args: tuple, kwargs: dict | None, caller: Any) -> bool:
    """Whether ``func(*args)``, called from the frame ``caller``, is the autograd engine
    summing two gradients that a CUDA run sums in place, into ``args[0]``.

    As the engine decides for a tensor nothing else holds: grad mode off (no
    ``create_graph``), the first gradient a dense tensor, not a view, that owns its storage
    and is referenced no more than the second (the engine's buffer holds the only reference; a
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
    if old._is_view():  # its base holds the storage too: the engine sums it out of place
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


_aten = torch.ops.aten
#: The out-of-place fills of those formulas, with their in-place twins.
IN_PLACE_SCATTERS: dict[Any, Any] = {
    _aten.scatter.src: _aten.scatter_.src,
    _aten.scatter.value: _aten.scatter_.value,
    _aten.scatter_add.default: _aten.scatter_add_.default,
    _aten.index_put.default: _aten.index_put_.default,
    _aten.index_add.default: _aten.index_add_.default,
    _aten.put.default: _aten.put_.default,
}
# The autograd nodes whose formulas fill their fresh zeros so (value_selecting_reduction_backward,
# index_backward, gather_backward, index_select_backward, take_backward,
# cummaxcummin_backward): the first argument is the formula's own zeros, which nothing else holds.
_FILLING_NODES = frozenset(
    {
        "MaxBackward0",
        "MinBackward0",
        "MedianBackward1",
        "NanmedianBackward1",
        "KthvalueBackward0",
        "ModeBackward0",
        "SortBackward0",
        "SortBackward1",
        "TopkBackward0",
        "CummaxBackward0",
        "CumminBackward0",
        "IndexBackward0",
        "GatherBackward0",
        "IndexSelectBackward0",
        "TakeBackward0",
    }
)


def scattered_in_place(func: Any, caller: Any) -> Any:
    """The in-place twin of ``func`` (one of :data:`IN_PLACE_SCATTERS`), called from the frame
    ``caller``, where a CUDA run makes it in place: a derivative formula filling the zeros it
    just made. None elsewhere (Python code in a backward, a hook, a user's own scatter)."""
    if caller is None or caller.f_code is not _ENGINE_CODE:
        return None
    node = torch._C._current_autograd_node()
    if node is None or type(node).__name__ not in _FILLING_NODES:
        return None
    return IN_PLACE_SCATTERS[func]
