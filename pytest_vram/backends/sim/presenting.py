"""Where a tensor is, as the test's code asks it.

On the simulated device every tensor is a ``cpu`` tensor (fake shape-only, real computing).
The simulated device knows which of them are on the host
(:mod:`~pytest_vram.backends.sim.hosttensors`), and a test's code sees that: a tensor on the
device answers ``x.device == torch.device("cuda", 0)``, ``x.is_cuda`` and
``x.get_device() == 0``, a host tensor ``cpu``, ``False`` and ``-1``, as on a GPU (a wrapper
subclass, such as a DTensor, where the tensor it wraps is). So a test
that moves a module with ``.to("cuda")`` finds its parameters on ``cuda:0``, compares a
result moved back with ``.cpu()`` against a host tensor, or runs DataParallel's device check.

Only Python reads these answers: kernels see the ``cpu`` tensors they compute on; while the
fake mode dispatches an op a fake tensor answers its own device, which FakeTensorMode relies
on, and so does every tensor while ``torch.compile`` compiles (Dynamo makes fake tensors of
its own from what it reads), whose graph then runs on the simulated device as eager code.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch._guards import CompileContext
from torch._subclasses.fake_tensor import FakeTensor

__all__ = ["CUDA", "presented_devices"]

CUDA = torch.device("cuda", 0)
_CPU = "cpu"
_TENSOR_DEVICE = torch._C.TensorBase.device
_TENSOR_GET_DEVICE = torch._C.TensorBase.get_device
_FAKE_DEVICE = FakeTensor.device
_compile_context = CompileContext.try_get
_PLAIN = frozenset({torch.Tensor, torch.nn.Parameter, FakeTensor})


def presented_devices(
    on_device: Callable[[torch.Tensor], bool],
) -> Iterator[tuple[object, str, object]]:
    """What to set, as ``(owner, name, value)`` (inherited attributes of ``torch.Tensor``
    included), so that a tensor ``on_device`` tells answers ``cuda:0``."""

    def device(self: torch.Tensor) -> torch.device:
        found = _TENSOR_DEVICE.__get__(self)
        # The compile context first: a thread-local read, where on_device looks up storages.
        if found.type != _CPU or _compile_context() is not None:
            return found
        if on_device(self):
            return CUDA
        if type(self) not in _PLAIN:
            # A wrapper subclass (DTensor) is where the tensor it wraps is.
            flatten = getattr(self, "__tensor_flatten__", None)
            if flatten is not None:
                inner, _ = flatten()
                if inner:
                    return getattr(self, inner[0]).device
        return found

    def fake_device(self: FakeTensor) -> torch.device:
        found = _FAKE_DEVICE.__get__(self)
        # Inside its dispatch the fake mode itself is asking.
        if (
            found.type != _CPU
            or getattr(self.fake_mode, "dispatching", 1)
            or _compile_context() is not None
        ):
            return found
        return CUDA if on_device(self) else found

    def is_cuda(self: torch.Tensor) -> bool:
        return self.device.type == "cuda"

    def get_device(self: torch.Tensor) -> int:
        found = self.device
        if found.type == "cuda":
            return found.index
        return -1 if found.type == _CPU else _TENSOR_GET_DEVICE(self)

    tensor = torch.Tensor
    yield tensor, "device", property(device)
    yield tensor, "is_cuda", property(is_cuda)
    yield tensor, "get_device", get_device
    yield FakeTensor, "device", property(fake_device)
