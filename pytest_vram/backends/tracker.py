"""Count the bytes of live tensor storages, exactly, by watching every dispatched op.

The cpu and sim backends share this: a ``TorchDispatchMode`` sees each op's outputs, registers
each storage it has not seen (views share one storage, so they count once), re-reads the size of
storages it knows (``resize_``, ``set_`` and ``out=`` ops return the tensor they changed) and a
weak-reference finalizer subtracts a storage when it dies.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_iter
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["StorageTracker", "round_like_cuda_allocator"]


def round_like_cuda_allocator(nbytes: int) -> int:
    """What the CUDA caching allocator hands out for a request: multiples of 512 bytes."""
    if nbytes <= 0:
        return 0
    return (nbytes + 511) // 512 * 512


class StorageTracker:
    """Live storage bytes, their peak, and a hook on every allocation.

    ``counts(tensor)`` decides which storages belong to the measured device, ``size_of(nbytes)``
    maps a storage's bytes to what the device would hand out, and ``on_allocate(nbytes)`` runs
    before a new storage is counted (the simulated device raises out-of-memory there).
    """

    def __init__(
        self,
        counts: Callable[[torch.Tensor], bool],
        size_of: Callable[[int], int] = lambda n: n,
        on_allocate: Callable[[int], None] | None = None,
    ) -> None:
        self._counts = counts
        self._size_of = size_of
        self._on_allocate = on_allocate
        self._sizes: WeakIdKeyDictionary = WeakIdKeyDictionary()
        # Finalizers may run on whichever thread drops the last reference, and may run while
        # this thread is already inside observe(); an RLock serves both.
        self._lock = threading.RLock()
        self.current = 0
        self.peak = 0
        self.mode = _TrackingMode(self)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.current

    def observe(self, tensor: torch.Tensor) -> None:
        """Count ``tensor``'s storage if it is new, or its new size if it was resized."""
        if not self._counts(tensor):
            return
        try:
            storage = tensor.untyped_storage()
        except (NotImplementedError, RuntimeError):  # sparse, nested and other storage-less kinds
            return
        size = self._size_of(storage.nbytes())
        with self._lock:
            box = self._sizes.get(storage)
            if box is None:
                if self._on_allocate is not None:
                    self._on_allocate(size)
                box = [size]
                self._sizes[storage] = box
                weakref.finalize(storage, self._release, box)
                self._add(size)
            elif box[0] != size:
                if size > box[0] and self._on_allocate is not None:
                    self._on_allocate(size - box[0])
                self._add(size - box[0])
                box[0] = size

    def observe_all(self, tree: Any) -> None:
        for leaf in tree_iter(tree):
            if isinstance(leaf, torch.Tensor):
                self.observe(leaf)

    def _add(self, nbytes: int) -> None:
        self.current += nbytes
        if self.current > self.peak:
            self.peak = self.current

    def _release(self, box: list[int]) -> None:
        with self._lock:
            self.current -= box[0]
            box[0] = 0


class _TrackingMode(TorchDispatchMode):
    # torch wraps every mode's __torch_dispatch__ so that its first call imports torch._dynamo
    # (over a second); this mode compiles nothing and opts out, as torch's docstring describes.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        out = func(*args, **(kwargs or {}))
        self.tracker.observe_all(out)
        return out
