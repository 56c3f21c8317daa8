"""The simulated device's FakeTensorMode: shape-only ops, each output counted once.

Shape-only, a measured test runs under :class:`SimFakeTensorMode`: every tensor carries its
shape, dtype and storage size but no data, so nothing is computed. The mode hands each op's
outputs to the storage tracker, answers ``.item()`` from the values known without computing
(:class:`~pytest_vram.backends.sim.known.KnownValues`), runs the autograd engine's gradient
sums in place as CUDA does, and multiplies grouped matrices in the dtypes the CPU kernel takes.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from pytest_vram.backends.gradsums import accumulates_in_place
from pytest_vram.backends.sim.known import KnownValues
from pytest_vram.backends.tracker import StorageTracker

__all__ = ["SimFakeTensorMode", "on_device"]

_LOCAL_SCALAR = torch.ops.aten._local_scalar_dense.default
_GROUPED_MM = torch.ops.aten._grouped_mm.default
_ADD = torch.ops.aten.add.Tensor
_ADD_IN_PLACE = torch.ops.aten.add_.Tensor


def on_device(tensor: torch.Tensor) -> bool:
    """Whether a shape-only test's ``tensor`` is device memory: every fake tensor of the
    simulation is, host tensors included; meta tensors are shapes only, and real tensors were
    made outside the simulation."""
    return isinstance(tensor, FakeTensor) and tensor.fake_device.type != "meta"


def _grouped_mm(
    mode: FakeTensorMode, func: Any, types: Any, args: tuple, kwargs: dict[str, Any]
) -> Any:
    """``torch._grouped_mm`` as the CPU kernel runs it.

    The meta kernel checks what CUDA's Hopper kernel needs (bfloat16 inputs); the CPU kernel,
    and CUDA's fallback, multiply float32 and float16 too (a Mixtral's experts in float32 or
    under autocast). For those, the result is the meta kernel's shape in the input's dtype.
    """
    names = ("mat_a", "mat_b", "offs", "bias", "out_dtype")
    bound = dict(zip(names, args, strict=False)) | kwargs
    mat_a, mat_b = bound["mat_a"], bound["mat_b"]
    if (
        (mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16)
        or bound.get("bias") is not None
        or not isinstance(mat_a, FakeTensor)
        or mat_a.dtype != mat_b.dtype
    ):
        return mode.dispatch(func, types, args, kwargs)
    from torch._meta_registrations import _create_grouped_mm_output_tensor
    from torch._subclasses.fake_tensor import in_kernel_invocation_manager

    with in_kernel_invocation_manager(mode):
        out = _create_grouped_mm_output_tensor(
            mat_a, mat_b, bound.get("offs"), bound.get("out_dtype")
        )
    return FakeTensor(mode, out, mat_a.fake_device)


class SimFakeTensorMode(FakeTensorMode):
    """FakeTensorMode that counts the storages of what each op returns.

    Counting here, rather than in a second dispatch mode stacked on top, saves a trip through
    Python for every op; only the ops a program calls are counted, not those FakeTensorMode
    runs inside them (decompositions), just as a mode stacked above would see them.
    """

    # Like the storage tracker's mode, this one opts out of the wrapper torch puts around every
    # mode's dispatch to keep Dynamo out of it: the wrapper costs every op, and nothing here
    # is compiled.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self._observe_output = tracker.observe_output
        self._depth = 0
        #: What is known of the fake tensors' values without computing them.
        self.known = KnownValues()

    def __deepcopy__(self, memo: dict[int, Any]) -> SimFakeTensorMode:
        # copy.deepcopy(model) copies each fake tensor's __dict__, its mode included; there is
        # one simulated device, and the copies belong to it.
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if func is _LOCAL_SCALAR:
            # .item(), bool(t): a value known without computing is the value a real run reads.
            value = self.known.item(args[0])
            if value is not None:
                return value
        elif func is _ADD and accumulates_in_place(func, args, kwargs, sys._getframe(1)):
            func = _ADD_IN_PLACE  # the autograd engine's gradient sum, in place as on CUDA
        self._depth += 1
        try:
            if func is _GROUPED_MM:
                out = _grouped_mm(self, func, types, args, kwargs or {})
            else:
                out = self.dispatch(func, types, args, kwargs)
        finally:
            self._depth -= 1
        if self._depth == 0:
            # Queries such as prim.device, a third of the ops, return no tensor: skip them cheaply.
            if isinstance(out, (torch.Tensor, tuple, list)):
                self._observe_output(func, out)
            self.known.after(func, args, kwargs or {}, out)
        return out
