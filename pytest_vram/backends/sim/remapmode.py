"""The function mode that sends CUDA device arguments to the simulated device's ``cpu``.

While a shape-only test runs, :class:`CudaRemapMode` makes ``device="cuda"`` (``"cuda:0"``,
``torch.device("cuda")``, ``0``) in any torch function, ``Tensor.to("cuda")`` and
``Tensor.cuda()`` put tensors on the (fake) ``cpu`` device, where FakeTensorMode can run
autograd and optimizers; a real tensor made before the test becomes a counted fake copy when
moved to ``cuda``. Pinning is a no-op, CUDA's autocast lists apply
(:mod:`~pytest_vram.backends.sim.autocast`), and an optimizer's host scalars are host memory
(:mod:`~pytest_vram.backends.sim.hostscalars`). Computing,
:mod:`~pytest_vram.backends.sim.cudaremap` does the same below Python, with
:func:`special_methods` for the calls that stay Python's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.overrides import TorchFunctionMode

from pytest_vram.backends.sim.autocast import (
    autocast_call,
    cuda_autocast_policies,
    real_is_autocast_enabled,
)
from pytest_vram.backends.sim.cudaremap import is_cuda_device
from pytest_vram.backends.sim.hostscalars import HOST_FACTORIES
from pytest_vram.backends.sim.hosttensors import HostTensors

__all__ = ["CudaRemapMode", "HostCudaRemapMode", "special_methods"]

_CPU = torch.device("cpu")
_compiling = torch.compiler.is_compiling


def _tensor_to(
    on_device: Callable[[torch.Tensor], bool], func: Callable, args: tuple, kwargs: dict
) -> Any:
    to_cuda = False
    if len(args) > 1 and is_cuda_device(args[1]):
        args = (args[0], _CPU, *args[2:])
        to_cuda = True
    device = kwargs.get("device")
    if device is not None and is_cuda_device(device):
        kwargs["device"] = _CPU
        to_cuda = True
    # A tensor made before the simulation moves to the device: a new, counted copy. The
    # simulated device's own name is "cpu".
    if to_cuda and len(args) < 5 and not on_device(args[0]):
        kwargs.setdefault("copy", True)
    return func(*args, **kwargs)


def _not_on(
    is_host: Callable[[torch.Tensor], bool], on_device: Callable[[torch.Tensor], bool]
) -> Callable[[torch.Tensor], bool]:
    """``on_device``, False for a tensor the test keeps on the host."""

    def on_device_not_host(tensor: torch.Tensor) -> bool:
        return on_device(tensor) and not is_host(tensor)

    return on_device_not_host


def _tensor_cuda(
    on_device: Callable[[torch.Tensor], bool], func: Callable, args: tuple, kwargs: dict
) -> Any:
    tensor = args[0]
    non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
    memory_format = kwargs.get("memory_format", torch.preserve_format)
    return tensor.to(
        _CPU,
        non_blocking=non_blocking,
        copy=not on_device(tensor),
        memory_format=memory_format,
    )


def _tensor_to_placed(
    on_device: Callable[[torch.Tensor], bool],
    host: HostTensors,
    func: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """``Tensor.to`` where the host is told from the device: a move between the host and the
    device copies, as on a GPU."""
    to_host = host.names_host(args[1]) if len(args) > 1 else None
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        # x.to(other) is x.to(other.device, other.dtype): by device, for PyTorch would read
        # the device other shows the test.
        args = (args[0], _CPU, args[1].dtype, *args[2:])
    elif len(args) > 1 and is_cuda_device(args[1]):
        args = (args[0], _CPU, *args[2:])
    device = kwargs.get("device")
    if device is not None:
        to_host = not is_cuda_device(device)
        kwargs["device"] = _CPU
    if to_host is None or len(args) >= 5 or on_device(args[0]) != to_host:
        return func(*args, **kwargs)
    kwargs.setdefault("copy", True)
    if to_host:
        with host.copying_to_host():
            return func(*args, **kwargs)
    with host.copying_to_device(args[0]):
        return func(*args, **kwargs)


def _tensor_cuda_placed(
    on_device: Callable[[torch.Tensor], bool],
    host: HostTensors,
    func: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """``Tensor.cuda`` where the host is told from the device."""
    if on_device(args[0]):
        return _tensor_cuda(on_device, func, args, kwargs)
    with host.copying_to_device(args[0]):
        return _tensor_cuda(on_device, func, args, kwargs)


def _tensor_cpu(
    on_device: Callable[[torch.Tensor], bool],
    host: HostTensors,
    func: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    tensor = args[0]
    if on_device(tensor):  # a copy on the host, as a GPU's tensor.cpu() makes
        memory_format = kwargs.get("memory_format", torch.preserve_format)
        with host.copying_to_host():
            return tensor.to(_CPU, copy=True, memory_format=memory_format)
    return func(*args, **kwargs)


def _tensor_format(func: Callable, args: tuple, kwargs: dict) -> Any:
    # f"{loss:.4f}" reads the value, as it does on a real tensor: a constant formats, anything
    # else raises FakeTensorMode's "needs values" error rather than a TypeError.
    tensor, spec = args[0], args[1] if len(args) > 1 else kwargs.get("format_spec", "")
    if spec and isinstance(tensor, FakeTensor) and tensor.dim() == 0:
        return format(tensor.item(), spec)
    return func(*args, **kwargs)


def _histc_like_cuda(
    host_memory: Callable[[], contextlib.AbstractContextManager[Any]] | None,
    func: Callable,
    args: tuple,
    kwargs: dict,
) -> Any:
    """``torch.histc`` of integers, which CUDA's kernel counts and the CPU's refuses (code that
    sees its tensor on ``cuda`` passes them, as transformers' MoE layers do): counted in
    float32 on the host, the device holding only the result, in the input's dtype."""
    tensor = args[0]
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or "out" in kwargs:
        return func(*args, **kwargs)
    with host_memory() if host_memory is not None else contextlib.nullcontext():
        counts = func(tensor.float(), *args[1:], **kwargs)
    return counts.to(tensor.dtype)


def _returns_self(func: Callable, args: tuple, kwargs: dict) -> Any:
    return args[0]


def _returns_false(func: Callable, args: tuple, kwargs: dict) -> Any:
    return False


def _is_fake(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, FakeTensor)


def special_methods(on_device: Callable[[torch.Tensor], bool]) -> dict[Callable, Callable]:
    """The tensor methods whose meaning on the simulated device is not a copy to the CPU, each
    with its replacement (called with the original, the arguments and the keyword arguments);
    ``on_device`` tells a tensor already on the device."""
    tensor = torch.Tensor
    return {
        tensor.to: functools.partial(_tensor_to, on_device),
        tensor.cuda: functools.partial(_tensor_cuda, on_device),
        tensor.__format__: _tensor_format,
        # Pinned host memory needs a CUDA runtime; on the simulated device it is plain memory.
        tensor.pin_memory: _returns_self,
        tensor.is_pinned: _returns_false,
    }


class CudaRemapMode(TorchFunctionMode):
    """Sends CUDA device arguments to the fake ``cpu`` device and applies CUDA autocast lists.

    Only the functions a test calls reach a function mode (what they call in turn does not),
    which is all that device arguments need; for autocast it means the corrections apply to the
    functions called directly, while CPU autocast, underneath, casts everything else. With
    ``host_memory``, a context in which the device counts nothing, the factory calls that
    ``host_scalar`` tells (an optimizer's own host tensors) run in it.
    """

    def __init__(
        self,
        on_device: Callable[[torch.Tensor], bool] = _is_fake,
        host_memory: Callable[[], contextlib.AbstractContextManager[Any]] | None = None,
        host_scalar: Callable[[Callable, tuple, dict | None], bool] | None = None,
    ) -> None:
        super().__init__()
        self._special = special_methods(on_device)
        self._autocast = cuda_autocast_policies()
        self._host_memory = host_memory
        self._host_scalar = host_scalar if host_memory is not None else None

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        if (
            func in HOST_FACTORIES
            and self._host_scalar is not None
            and self._host_scalar(func, args, kwargs)
        ):
            with self._host_memory():  # type: ignore[misc]
                return func(*args, **(kwargs or {}))
        special = self._special.get(func)
        if special is not None:  # each reads the device it is given itself
            return special(func, args, dict(kwargs) if kwargs else {})
        if kwargs:
            device = kwargs.get("device")
            if device is not None and is_cuda_device(device):
                kwargs = {**kwargs, "device": _CPU}
            if kwargs.get("pin_memory"):
                kwargs = {**kwargs, "pin_memory": False}
        else:
            kwargs = {}
        policy = self._autocast.get(func)
        if policy is not None and real_is_autocast_enabled("cpu"):
            return autocast_call(policy, func, args, dict(kwargs))
        return func(*args, **kwargs)


class HostCudaRemapMode(CudaRemapMode):
    """:class:`CudaRemapMode` where the tensors a call makes are on the host or the device as
    the call says (:mod:`~pytest_vram.backends.sim.hosttensors`)."""

    def __init__(
        self,
        host: HostTensors,
        on_device: Callable[[torch.Tensor], bool] = _is_fake,
        **options: Any,
    ) -> None:
        super().__init__(on_device, **options)
        self._host = host
        #: Whether a tensor is on the device: not one the test keeps on the host.
        self.on_device = on_device = _not_on(host.is_host, on_device)
        tensor = torch.Tensor
        self._special = {
            **special_methods(on_device),
            tensor.to: functools.partial(_tensor_to_placed, on_device, host),
            tensor.cuda: functools.partial(_tensor_cuda_placed, on_device, host),
            tensor.cpu: functools.partial(_tensor_cpu, on_device, host),
        }
        histc = functools.partial(_histc_like_cuda, options.get("host_memory"))
        self._special.update({torch.histc: histc, tensor.histc: histc})

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        # Dynamo traces a function mode into its graph: the placement, which reads storages
        # and the mode stack, is left to the ops the graph runs.
        host = None if _compiling() else self._host.placement(func, args, kwargs)
        if host is None:  # nearly every call
            return _remap(self, func, types, args, kwargs)
        return self._host.run_placed(host, lambda: _remap(self, func, types, args, kwargs))


_remap = CudaRemapMode.__torch_function__
