"""Foreach ops on the simulated device, run once for each kind of tensor in their lists.

An optimizer's foreach step calls each ``torch._foreach_*`` op on all its parameters at once,
and FakeTensorMode runs the op's meta function position by position, a tenth of a millisecond
or more each: a second for each step of a 32B model's 771 parameters. Those parameters come in
a handful of shapes. A foreach op works on each position of its lists alone, so the positions
whose tensors have the same shape, stride, dtype and device, with the same scalars, get outputs
alike: :func:`by_kind` runs the op on the first position of each kind and gives every other
position a new fake tensor like its kind's output.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["by_kind", "group_by_kind", "is_foreach", "kinds"]

_STRIDED = torch.strided
_SCALARS = (int, float, bool)
# Below this many positions, working out the kinds costs more than it saves.
_FEWEST = 8


class _Foreach(dict):
    """Each op, to whether it is one of aten's foreach ops."""

    def __missing__(self, func: Any) -> bool:
        schema = getattr(func, "_schema", None)
        foreach = schema is not None and schema.name.startswith("aten::_foreach_")
        self[func] = foreach
        return foreach


_FOREACH = _Foreach()


def is_foreach(func: Any) -> bool:
    """Whether ``func`` is one of aten's ``_foreach_*`` ops."""
    try:
        return _FOREACH[func]
    except TypeError:  # an unhashable callable
        return False


def _kind(item: Any, mode: Any) -> Any:
    """What a foreach op's output at one position depends on, of one list's item there; None
    for an item this module leaves to FakeTensorMode (another mode's or a constant fake
    tensor, symbolic sizes, a sparse tensor, anything but a number)."""
    kind = type(item)
    if kind is FakeTensor:
        if (
            item.fake_mode is not mode
            or item.constant is not None
            or item.layout is not _STRIDED
            or item._has_symbolic_sizes_strides
        ):
            return None
        return (item.shape, item.stride(), item.dtype, item.fake_device)
    if kind in _SCALARS:
        return (kind, item)
    return None


def kinds(mode: Any, args: tuple, kwargs: dict[str, Any]) -> tuple[list[int], list[int]] | None:
    """The first position of each kind in a foreach op's lists, and each position's kind (an
    index into the first); None where the op is not run by kind: lists of different lengths,
    or too short to gain, an item :func:`_kind` leaves alone, a single tensor beside the lists
    (a tensor of scalars, one for each position), or as many kinds as positions."""
    lists = [arg for arg in args if isinstance(arg, (list, tuple))]
    if not lists or len({len(arg) for arg in lists}) != 1 or len(lists[0]) < _FEWEST:
        return None
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            return None
    if any(isinstance(value, (list, tuple)) for value in kwargs.values()):
        return None
    split = group_by_kind(lists, lambda item: _kind(item, mode))
    return split if split is not None and len(split[0]) < len(split[1]) else None


def group_by_kind(
    lists: list[Any], kind_of_item: Callable[[Any], Any]
) -> tuple[list[int], list[int]] | None:
    """The first position of each kind across ``lists`` (all of one length), and each
    position's kind (an index into the first). A position's kind is the kinds of its items, by
    ``kind_of_item``; None where an item has none (``kind_of_item`` gives None) or its kind does
    not hash (symbolic sizes)."""
    seen: dict[Any, int] = {}
    first: list[int] = []
    kind_of: list[int] = []
    try:
        for position, items in enumerate(zip(*lists, strict=True)):
            key = tuple(kind_of_item(item) for item in items)
            if None in key:
                return None
            kind = seen.get(key)
            if kind is None:
                kind = seen[key] = len(first)
                first.append(position)
            kind_of.append(kind)
    except TypeError:
        return None
    return first, kind_of


def by_kind(
    mode: Any,
    dispatch: Callable[[Any, Any, tuple, dict[str, Any]], Any],
    make_like: Callable[[FakeTensor], FakeTensor],
    func: Any,
    types: Any,
    args: tuple,
    kwargs: dict[str, Any],
) -> Any:
    """``func(*args, **kwargs)`` for a foreach op, by ``dispatch`` on the first position of each
    kind (see :func:`kinds`), every other position's output made by ``make_like`` from its
    kind's; where the op is not run by kind, ``dispatch`` on everything."""
    split = kinds(mode, args, kwargs)
    if split is None:
        return dispatch(func, types, args, kwargs)
    first, kind_of = split
    picked = tuple(
        type(arg)(arg[position] for position in first) if isinstance(arg, (list, tuple)) else arg
        for arg in args
    )
    out = dispatch(func, types, picked, kwargs)
    if out is None:  # in place: the op checked each kind, and wrote nothing a fake tensor holds
        return None
    if not (
        isinstance(out, (list, tuple))
        and len(out) == len(first)
        and all(type(tensor) is FakeTensor for tensor in out)
    ):
        return dispatch(func, types, args, kwargs)
    outputs = []
    for position, kind in enumerate(kind_of):
        # The first of a kind takes the output made for it; the others, new ones like it.
        outputs.append(out[kind] if first[kind] == position else make_like(out[kind]))
    return type(out)(outputs)
