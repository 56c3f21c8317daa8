"""Where each tensor of a test is, the host or the device, as the test's code placed it.

On a GPU, a tensor made without a device (while the default device is the host's) is host
memory, and so is whatever is computed from host tensors alone; ``.to("cuda")`` copies it to
the device. A model built that way and then moved (``Linear`` makes its weight on the host,
``model.to("cuda")`` copies it) is only on the device after the move. On the simulated device
every tensor is a ``cpu`` tensor (fake, or computing real), so it tells the two apart itself:

- a factory called without a device, with no default device set (``torch.set_default_device``
  or ``with torch.device(...)``), or with ``pin_memory=True``, makes host tensors;
- a call whose tensor arguments are all host tensors makes host tensors (what a function
  makes inside, its temporaries included, is on its arguments' device), and shape-only so does
  an op that only host tensors reach (autograd's backward of a host computation);
- a call that names the host (``device="cpu"``, ``.cpu()``, ``.to("cpu")``) makes host
  tensors, and one that names the device (``device="cuda"``, ``.cuda()``, ``.to("cuda")``)
  makes device tensors; moving a tensor from one to the other copies it, as a GPU does.

The test's code sees where each tensor is (:mod:`~pytest_vram.backends.sim.presenting`): a
device tensor answers ``cuda:0``, a host tensor ``cpu``; ``vram.device`` is ``cuda``.

What the device counts depends on ``--vram-sim-host-tensors``:

- ``host``: the device does not count a host tensor;
- ``device`` (the default): the device counts every tensor the test makes, host tensors too,
  and a move counts a tensor once: a host tensor copied to the device hands its count to its
  copy (where the copy is all of its storage), and a device tensor's copy on the host is not
  counted.

A host tensor's storage carries a mark. Calls are placed by
:class:`~pytest_vram.backends.sim.remapmode.HostCudaRemapMode`, ops by the fake mode
(shape-only); computing, a call whose tensors the device does not count runs where it counts
nothing.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext, _device_constructors

from pytest_vram.backends.sim.cudaremap import is_cuda_device

__all__ = ["HostTensors"]

_MARK = "_pytest_vram_host"
# A tensor without a storage, or without one yet (a lazy module's uninitialised parameter).
_NO_STORAGE = (NotImplementedError, RuntimeError, ValueError)
_TENSOR_TO = torch.Tensor.to
_TENSOR_CUDA = torch.Tensor.cuda
_TENSOR_CPU = torch.Tensor.cpu


class _Live:
    """How many marked storages are alive: while none is, nothing needs to be looked at."""

    count = 0


class _Mark:
    # On the storage's Python object, which PyTorch keeps exactly as long as the storage.
    __slots__ = ("_live",)

    def __init__(self, live: _Live) -> None:
        self._live = live
        live.count += 1

    def __del__(self) -> None:
        self._live.count -= 1


class _Making(threading.local):
    #: True inside a call that makes host tensors, False inside one that names the device,
    #: None elsewhere (an op's outputs are on its inputs' device).
    host: bool | None = None
    #: Inside a copy from the device to the host, which the device never counts.
    copy_to_host: bool = False


class HostTensors:
    """Marks the tensors a test keeps on the host, and tells them from the device's."""

    def __init__(
        self,
        counted: Callable[[torch.Tensor], bool],
        counts_host: bool = False,
        hand_over: Callable[[torch.Tensor], contextlib.AbstractContextManager[Any]] | None = None,
    ) -> None:
        #: Whether the device counts a tensor's storage.
        self._counted = counted
        #: Whether the device counts host tensors (``device``) or not (``host``).
        self.counts_host = counts_host
        #: With ``counts_host``: a context in which a storage counts no more and the copy of
        #: it made inside counts it.
        self._hand_over = hand_over
        #: Computing: a context in which the device counts nothing, where a call that makes
        #: host tensors runs (shape-only, the fake mode leaves them uncounted as it marks them).
        self.uncounted: Callable[[], contextlib.AbstractContextManager[Any]] | None = None
        self._live = _Live()
        self._making = _Making()
        self._factories = frozenset(_device_constructors())

    @property
    def live(self) -> int:
        """How many host storages are alive."""
        return self._live.count

    def is_host(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` is on the host (its storage is marked)."""
        if not self._live.count:
            return False
        try:
            return hasattr(tensor.untyped_storage(), _MARK)
        except _NO_STORAGE:
            return False

    @contextlib.contextmanager
    def making(self, host: bool) -> Iterator[None]:
        """Inside, new tensors are host tensors (``host``) or the device's (not ``host``)."""
        making = self._making
        before, making.host = making.host, host
        try:
            yield
        finally:
            making.host = before

    def run_placed(self, host: bool, run: Callable[[], Any]) -> Any:
        """Run ``run()``, a call :meth:`placement` placed, where its new tensors are host
        tensors (``host``) or the device's; computing, they are marked here (and made
        uncounted where the device does not count host tensors)."""
        with self.making(host):
            if not host or self.uncounted is None:
                return run()
            if self.counts_host:
                out = run()
            else:
                with self.uncounted():
                    out = run()
        self._mark_all(out)
        return out

    @contextlib.contextmanager
    def copying_to_host(self) -> Iterator[None]:
        """Inside, a device tensor is copied to the host: a copy the device never counts."""
        making = self._making
        before, making.copy_to_host = making.copy_to_host, True
        try:
            if self.counts_host and self.uncounted is not None:
                with self.uncounted():
                    yield
            else:
                yield
        finally:
            making.copy_to_host = before

    @contextlib.contextmanager
    def copying_to_device(self, source: torch.Tensor) -> Iterator[None]:
        """Inside, ``source``, a host tensor, is copied to the device: where the device counts
        host tensors and the copy is all of its storage, the copy takes over its count."""
        if self._hand_over is None or not self.counts_host or not _whole_storage(source):
            yield
            return
        with self._hand_over(source):
            yield

    def placement(self, func: Callable, args: tuple, kwargs: dict | None) -> bool | None:
        """Where the call ``func(*args, **kwargs)`` puts the tensors it makes: on the host
        (True), on the device (False), or on its arguments' device as each op does (None)."""
        if kwargs:
            if kwargs.get("pin_memory"):
                return True
            device = kwargs.get("device")
            if device is not None:
                return not is_cuda_device(device)
        if func in self._factories and not _any_tensor(args):  # torch.tensor(t): t's device
            return None if _default_device_set() else True
        if func is _TENSOR_CUDA:
            return False
        if func is _TENSOR_CPU:
            return True
        if func is _TENSOR_TO and len(args) > 1:
            named = self.names_host(args[1])
            if named is not None:
                return named
        if self._live.count:
            return self._all_host(args, kwargs)
        return None

    def names_host(self, arg: Any) -> bool | None:
        """Whether ``arg``, the first argument of ``Tensor.to`` after the tensor, names the
        host (True) or the device (False); None where it names no device (a dtype)."""
        if isinstance(arg, torch.Tensor):  # x.to(other): other's device
            return self.is_host(arg) or not self._counted(arg)
        if isinstance(arg, (str, torch.device)):
            return not is_cuda_device(arg)
        if isinstance(arg, int) and not isinstance(arg, bool):
            return False  # a bare index is a CUDA device
        return None

    def _all_host(self, args: tuple, kwargs: dict | None) -> bool | None:
        """True when the tensors among the arguments are all on the host; None when there are
        none, or some are on the device."""
        seen = False
        for arg in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(arg, torch.Tensor):
                if not self.is_host(arg):
                    return None
                seen = True
            elif isinstance(arg, (list, tuple)):
                for item in arg:
                    if isinstance(item, torch.Tensor):
                        if not self.is_host(item):
                            return None
                        seen = True
        return True if seen else None

    def place(self, args: tuple, kwargs: dict | None, out: Any) -> bool:
        """Mark ``out``, an op's new outputs, as host tensors where the call that runs says so
        or where all the op's tensor arguments are on the host; True when the device does not
        count them."""
        making = self._making
        host = making.host
        if host is None:
            if not self._live.count:
                return False
            host = self._all_host(args, kwargs) or False
        if not host:
            return False
        self._mark_all(out)
        return not self.counts_host or making.copy_to_host

    def _mark_all(self, out: Any) -> None:
        if isinstance(out, torch.Tensor):
            self._mark(out)
        elif isinstance(out, (list, tuple)):
            for item in out:
                if isinstance(item, torch.Tensor):
                    self._mark(item)

    def _mark(self, tensor: torch.Tensor) -> None:
        try:
            storage = tensor.untyped_storage()
        except _NO_STORAGE:
            return
        if not hasattr(storage, _MARK) and (self.counts_host or not self._counted(tensor)):
            setattr(storage, _MARK, _Mark(self._live))


def _whole_storage(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is all of its storage (not a part of a larger one)."""
    try:
        nbytes = tensor.untyped_storage().nbytes()
    except _NO_STORAGE:
        return False
    return tensor.storage_offset() == 0 and tensor.numel() * tensor.element_size() == nbytes


def _any_tensor(args: tuple) -> bool:
    return any(isinstance(arg, torch.Tensor) for arg in args)


def _default_device_set() -> bool:
    """Whether a default device is set (``set_default_device``, ``with torch.device(...)``):
    its factories name that device."""
    return any(isinstance(mode, DeviceContext) for mode in _get_current_function_mode_stack())
