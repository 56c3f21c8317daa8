"""cuBLAS workspaces of the simulated device, and the GPU model it simulates.

On a GPU, the first matrix multiply a thread runs on a stream makes PyTorch give that (thread,
stream) a cuBLAS workspace, allocated through the caching allocator and kept until
``torch._C._cuda_clearCublasWorkspaces()`` (``aten/src/ATen/cuda/CublasHandlePool.cpp``:
``setCublasWorkspace``; cuBLASLt shares it unless ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=0``). Its
size is ``getChosenWorkspaceSize()``: the sum of SIZE KiB times COUNT over the ``:SIZE:COUNT``
pairs of ``CUBLAS_WORKSPACE_CONFIG``, else 32 MiB on compute capability 9.x, 10.x and 12.x and
``:4096:2:16:8`` (8 MiB 128 KiB) before. Backward runs on autograd's device thread, so a
training step holds two.

The per-test clean-up clears the workspaces before every test, so each test that multiplies
matrices allocates its own; :class:`CublasWorkspaces` does the same on the simulated device.
"""

from __future__ import annotations

import functools
import os
import re
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch

__all__ = [
    "DEFAULT_GPU",
    "GPU_MODELS",
    "WORKSPACE_NAME",
    "CublasWorkspaces",
    "GpuModel",
    "configured_workspace_size",
    "cublas_workspace",
    "gpu_model",
    "matmul_ops",
    "workspace_size",
]

#: What breakdowns call the workspaces (category ``cublas_workspaces``).
WORKSPACE_NAME = "cuBLAS workspace"

KiB, MiB = 1 << 10, 1 << 20


class GpuModel(NamedTuple):
    """A GPU the simulated device can stand for."""

    name: str
    #: ``torch.cuda.get_device_properties().total_memory``, to 0.01 GiB.
    total_memory: int
    major: int
    minor: int


def _gib(value: float) -> int:
    return round(value * (1 << 30)) // MiB * MiB


#: Known models by the name ``torch.cuda.get_device_name()`` gives them.
GPU_MODELS: dict[str, GpuModel] = {
    model.name: model
    for model in (
        GpuModel("NVIDIA A100-SXM4-40GB", _gib(39.39), 8, 0),
        GpuModel("NVIDIA A100-SXM4-80GB", _gib(79.15), 8, 0),
        GpuModel("NVIDIA GeForce RTX 4090", _gib(23.65), 8, 9),
        GpuModel("NVIDIA H100 80GB HBM3", _gib(79.11), 9, 0),
        GpuModel("NVIDIA H200", _gib(139.81), 9, 0),
    )
}
#: The model simulated unless ``--vram-sim-gpu`` names another: the most common training GPU.
DEFAULT_GPU = "NVIDIA H100 80GB HBM3"


def gpu_model(name: str) -> GpuModel:
    """The known model called ``name`` (case and surrounding spaces do not matter); a
    ValueError that lists the known names otherwise."""
    wanted = " ".join(name.split()).casefold()
    for known, model in GPU_MODELS.items():
        if known.casefold() == wanted:
            return model
    raise ValueError(
        f"{name!r} is not a known GPU model: expected one of " + ", ".join(sorted(GPU_MODELS))
    )


_CONFIG_PAIR = re.compile(r":([0-9]+):([0-9]+)")


def workspace_size(major: int, config: str | None = None) -> int:
    """The bytes of one cuBLAS workspace on a GPU of compute capability ``major``.x, with
    ``CUBLAS_WORKSPACE_CONFIG`` set to ``config`` (None: unset). A config without a
    ``:SIZE:COUNT`` pair gets the default, as PyTorch gives it (with a warning)."""
    default = 32 * MiB if major in (9, 10, 12) else 4096 * KiB * 2 + 16 * KiB * 8
    if config is None:
        return default
    pairs = _CONFIG_PAIR.findall(config)
    if not pairs:
        return default
    return sum(int(size) * KiB * int(count) for size, count in pairs)


_MATMUL_NAMES = (
    "mm",
    "addmm",
    "_addmm_activation",
    "bmm",
    "baddbmm",
    "addbmm",
    "mv",
    "addmv",
    "dot",
    "vdot",
    "_int_mm",
    "_scaled_mm",
)


@functools.cache
def matmul_ops() -> frozenset[Any]:
    """The aten ops that run on cuBLAS on a GPU, and so need a workspace."""
    import torch

    ops = set()
    for name in _MATMUL_NAMES:
        packet = getattr(torch.ops.aten, name, None)
        if packet is not None:
            ops.update(getattr(packet, overload) for overload in packet.overloads())
    return frozenset(ops)


# Backward runs on autograd's thread for the device, whichever thread called backward().
_AUTOGRAD_THREAD = "autograd"


class CublasWorkspaces:
    """The cuBLAS workspaces of the simulated device: ``allocate(nbytes)`` makes one (a
    tensor the device counts), held until :meth:`clear`.

    There is one stream on the simulated device, so a workspace is per thread.
    """

    def __init__(self, size: int, allocate: Callable[[int], torch.Tensor]) -> None:
        self.size = size
        self._allocate = allocate
        self._held: dict[object, torch.Tensor] = {}
        self._lock = threading.Lock()
        #: Whether a workspace is held elsewhere for the calling thread (True: for autograd's):
        #: by the op counter that a running test moved from, which keeps its own.
        self.held_elsewhere: Callable[[bool], bool] | None = None

    def on_matmul(self) -> None:
        """A matrix multiply ran: its thread gets a workspace if it has none."""
        import torch

        thread = (
            _AUTOGRAD_THREAD
            if torch._C._current_autograd_node() is not None
            else threading.get_ident()
        )
        if thread in self._held:
            return
        elsewhere = self.held_elsewhere
        if elsewhere is not None and elsewhere(thread == _AUTOGRAD_THREAD):
            return
        with self._lock:
            if thread not in self._held:
                self._held[thread] = cublas_workspace(self._allocate, self.size)

    def clear(self) -> None:
        """Let every workspace go, as ``torch._C._cuda_clearCublasWorkspaces()`` does."""
        with self._lock:
            self._held.clear()

    def held(self) -> list[torch.Tensor]:
        """The workspaces held now."""
        return list(self._held.values())


def cublas_workspace(allocate: Callable[[int], torch.Tensor], nbytes: int) -> torch.Tensor:
    """One cuBLAS workspace; this function's name is the frame a snapshot shows for it."""
    return allocate(nbytes)


def configured_workspace_size(major: int) -> int:
    """:func:`workspace_size` with this process's ``CUBLAS_WORKSPACE_CONFIG``."""
    return workspace_size(major, os.environ.get("CUBLAS_WORKSPACE_CONFIG"))
