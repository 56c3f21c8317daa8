"""CUDA device arguments on a build of PyTorch without CUDA, below Python.

The simulated device sends ``device="cuda"`` to the CPU with a function mode
(:class:`~pytest_vram.backends.sim.remapmode.CudaRemapMode`), which costs every call of a torch
function a Python call: more than the op itself when tensors are small. A test that computes
its values on a build without CUDA and does not see CUDA (one simulated only because of
``--vram-gate=all``, whose code takes the machine's paths and never asks where a tensor is)
gets the same answers from below Python instead, where an op that names no device costs
nothing more:

- the two ops that every factory and copy allocates through, ``empty.memory_format`` and
  ``empty_strided``, get kernels for the CUDA dispatch key that allocate on the CPU, so that
  whatever asks for a CUDA tensor gets a CPU one;
- CUDA devices get a device guard that does nothing (the build has none), for the code that
  sets the device of what it makes, as ``torch.tensor(data, device="cuda")`` does.

The few calls whose meaning on the simulated device is not a copy to the CPU stay Python's,
as in the function mode: ``Tensor.to`` and ``Tensor.cuda`` of a tensor already on the device
return it, pinning is a no-op, an optimizer's host scalars (AdamW's ``step``) are host memory,
and inside ``torch.autocast("cuda")`` the function mode runs, for CUDA's autocast op lists.

On a build with CUDA nothing here is used: its CUDA kernels are never replaced.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.amp.autocast_mode
from torch.nn.parameter import UninitializedTensorMixin

from pytest_vram.backends.cpu import allocator as cpu_allocator

__all__ = ["activate", "available", "deactivate", "is_cuda_device", "replacements"]

_CPU = torch.device("cpu")
_NOT_COMPILED = "Torch not compiled with CUDA enabled"
_library: torch.library.Library | None = None
_active = False


class _Checking(threading.local):
    active = False


_checking = _Checking()


def available() -> bool:
    """Whether this build lacks CUDA and the counting library (which holds the guard) loads."""
    if torch.backends.cuda.is_built():
        return False
    try:
        cpu_allocator.load()
    except cpu_allocator.CounterUnavailable:
        return False
    return True


# The kernels of the CUDA dispatch key: the schemas' keyword arguments, a CPU allocation.
def _empty(
    size: Any,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: Any = None,
    pin_memory: bool | None = None,
    memory_format: torch.memory_format | None = None,
) -> torch.Tensor:
    if not _active:
        raise AssertionError(_NOT_COMPILED)
    return torch.empty(size, dtype=dtype, layout=layout, device=_CPU, memory_format=memory_format)


def _empty_strided(
    size: Any,
    stride: Any,
    *,
    dtype: torch.dtype | None = None,
    layout: torch.layout | None = None,
    device: Any = None,
    pin_memory: bool | None = None,
) -> torch.Tensor:
    if not _active:
        raise AssertionError(_NOT_COMPILED)
    return torch.empty_strided(size, stride, dtype=dtype, layout=layout, device=_CPU)


def activate() -> None:
    """Make CUDA tensors CPU ones until :func:`deactivate`; call only where :func:`available`."""
    global _library, _active
    if _library is None:
        # Registered once a process: the kernels refuse, as the build would, while inactive.
        library = torch.library.Library("aten", "IMPL")
        library.impl("empty.memory_format", _empty, "CUDA")
        library.impl("empty_strided", _empty_strided, "CUDA")
        _library = library
    if cpu_allocator.load().pytest_vram_cuda_guard(1) != 0:
        raise RuntimeError("a CUDA device guard is registered in a build without CUDA")
    _active = True


def deactivate() -> None:
    global _active
    _active = False
    cpu_allocator.load().pytest_vram_cuda_guard(0)


def is_cuda_device(device: object) -> bool:
    """Whether a ``device=`` value names a CUDA device: ``"cuda"``, ``"cuda:1"``, a
    ``torch.device`` of type cuda, or a bare index (which PyTorch reads as a CUDA device)."""
    if isinstance(device, torch.device):
        return device.type == "cuda"
    if isinstance(device, str):
        return device == "cuda" or device.startswith("cuda:")
    return isinstance(device, int) and not isinstance(device, bool)


# Factories that take pin_memory=: pinning needs a CUDA runtime; here it is plain memory. The
# rest of the factories reach the CUDA kernels above with their device, pinning nothing.
_PINNING_FACTORIES = ("empty", "empty_like", "empty_strided", "zeros", "zeros_like", "ones",
                      "ones_like", "full", "full_like", "rand", "rand_like", "randn", "randn_like",
                      "randint", "randint_like", "randperm", "arange", "linspace", "logspace",
                      "eye", "tensor", "scalar_tensor")  # fmt: skip
_PINNING_METHODS = ("new_empty", "new_empty_strided", "new_zeros", "new_ones", "new_full",
                    "new_tensor")  # fmt: skip


def _factory(
    original: Callable[..., torch.Tensor],
    host_scalar: Callable[[Callable, tuple, dict | None], bool] | None,
    host_memory: Callable[[], Any] | None,
) -> Callable[..., torch.Tensor]:
    """``original`` with its device sent to the CPU, pinning nothing; with ``host_scalar``,
    what it makes of an optimizer's host scalars is host memory."""
    if host_memory is None:
        host_scalar = None

    @functools.wraps(original)
    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        # The check makes tensors itself (torch.get_default_device does), as the originals.
        if host_scalar is not None and not _checking.active:
            _checking.active = True
            try:
                host = host_scalar(original, args, kwargs)
            finally:
                _checking.active = False
            if host:
                assert host_memory is not None
                with host_memory():
                    return original(*args, **kwargs)
        if kwargs:
            device = kwargs.get("device")
            if device is not None and is_cuda_device(device):
                kwargs["device"] = _CPU
            if kwargs.get("pin_memory"):
                kwargs["pin_memory"] = False
        return original(*args, **kwargs)

    return make


def _method(special: Callable, original: Callable) -> Callable:
    @functools.wraps(original)
    def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        return special(original, (self, *args), kwargs)

    return method


# What a device argument may be: "cuda", "cuda:1", torch.device("cuda"), a bare index.
_DEVICE_ARGUMENTS = (str, torch.device, int)


def _to_method(special: Callable, original: Callable) -> Callable:
    """``Tensor.to``: most calls name a dtype or another tensor, which go to the original
    straight away; a device goes to ``special``."""

    @functools.wraps(original)
    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if (not args or not isinstance(args[0], _DEVICE_ARGUMENTS)) and "device" not in kwargs:
            return original(self, *args, **kwargs)
        return special(original, (self, *args), kwargs)

    return to


def _autocast_with_mode(mode: Any) -> Iterator[tuple[object, str, object]]:
    """``torch.autocast("cuda")`` blocks run under ``mode``, which applies CUDA's op lists."""
    autocast = torch.amp.autocast_mode.autocast
    enter, leave = autocast.__enter__, autocast.__exit__

    def __enter__(self: Any) -> Any:
        result = enter(self)
        if getattr(self, "_pytest_vram_cuda", False):
            mode.__enter__()
            self.__dict__.setdefault("_pytest_vram_modes", []).append(mode)
        return result

    def __exit__(self: Any, *exc: Any) -> Any:
        modes = self.__dict__.get("_pytest_vram_modes")
        if modes:
            modes.pop().__exit__(None, None, None)
        return leave(self, *exc)

    yield autocast, "__enter__", __enter__
    yield autocast, "__exit__", __exit__


def replacements(
    specials: dict[Callable, Callable],
    host_factories: frozenset[Callable],
    host_scalar: Callable[[Callable, tuple, dict | None], bool],
    host_memory: Callable[[], Any] | None,
    autocast_mode: Any,
) -> Iterator[tuple[object, str, object]]:
    """What to set, as ``(owner, name, value)``, while a computing test runs: the tensor
    methods of ``specials`` (the function mode's replacements, called with the original, the
    arguments and the keyword arguments), the factories that pin or make an optimizer's host
    scalars, the CUDA lazy initialisation (a no-op) and autocast's entry and exit."""
    methods: dict[Callable, Callable] = {}
    for original, special in specials.items():
        name = getattr(original, "__name__", None)
        if name == "to":
            methods[original] = _to_method(special, original)
        elif name is not None and name != "__format__":
            methods[original] = _method(special, original)
    for original, method in methods.items():
        yield torch.Tensor, original.__name__, method
    # A lazy module's uninitialised parameter refuses every method but the ones it lists by
    # identity (to, cuda, cpu, ...): the replacements of those are allowed too.
    allowed = UninitializedTensorMixin._allowed_methods
    extra = [methods[method] for method in allowed if method in methods]
    if extra:
        yield UninitializedTensorMixin, "_allowed_methods", [*allowed, *extra]
    made = {original.__name__: original for original in host_factories}
    for name in _PINNING_FACTORIES:
        original = getattr(torch, name, None)
        if original is not None:
            made.setdefault(name, original)
    for name, original in made.items():
        check = host_scalar if original in host_factories else None
        yield torch, name, _factory(original, check, host_memory)
    for name in _PINNING_METHODS:
        original = getattr(torch.Tensor, name, None)
        if original is not None:
            yield torch.Tensor, name, _factory(original, None, None)
    yield torch.cuda, "_lazy_init", lambda: None
    yield from _autocast_with_mode(autocast_mode)
