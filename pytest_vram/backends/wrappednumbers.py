"""Wrapped numbers as a Python dispatch mode is handed them, made tensors again.

A Python number in a tensor expression (``x * 2.0``) becomes a "wrapped number": a 0-dim tensor
that promotes as a number does. TorchScript keeps such constants in its graphs, and torch hands
them to a Python dispatch mode's ``__torch_dispatch__`` as Python numbers, which the op's own
call then refuses for most ops (``aten::view() Expected a value of type 'Tensor' ... found type
'float'``): a traced module checked against other inputs (``torch.jit.trace(...,
check_inputs=...)``) fails under the counting mode that way. :func:`numbers_as_tensors` gives
the call its tensors back.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["numbers_as_tensors"]


# What a wrapped number is, by the Python type torch hands it over as.
_WRAPPED_DTYPES: dict[type, torch.dtype] = {
    bool: torch.bool,
    int: torch.int64,
    float: torch.float64,
    complex: torch.complex128,
}


# How the op's call refuses a number where its schema wants a tensor (before anything runs).
_REFUSED = "Expected a value of type 'Tensor'"


def numbers_as_tensors(
    func: Any, args: tuple, kwargs: dict, error: BaseException
) -> tuple[tuple, dict] | None:
    """The op's arguments with each Python number where its schema wants a Tensor made the
    tensor it was, where ``error`` is the call's refusal of such a number; None otherwise.

    The tensor made is a plain 0-dim one of the wrapped number's dtype (float64 for a float):
    beside a tensor with dimensions it promotes as the number did, beside another 0-dim
    tensor as a float64 tensor does.
    """
    schema = getattr(func, "_schema", None)
    if schema is None or _REFUSED not in str(error):
        return None
    changed = False
    positional = list(args)
    named = dict(kwargs)
    for index, argument in enumerate(schema.arguments):
        if argument.type.kind() != "TensorType":
            continue
        if index < len(positional) and not argument.kwarg_only:
            value = positional[index]
        elif argument.name in named:
            value = named[argument.name]
        else:
            continue
        dtype = _WRAPPED_DTYPES.get(type(value))
        if dtype is None:
            continue
        tensor = torch.tensor(value, dtype=dtype)
        if index < len(positional) and not argument.kwarg_only:
            positional[index] = tensor
        else:
            named[argument.name] = tensor
        changed = True
    return (tuple(positional), named) if changed else None
