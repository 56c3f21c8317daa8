"""Backends measure memory; :func:`create_backend` makes one by name from :data:`REGISTRY`.

Nothing here imports torch: a backend module (and torch with it) is imported only when a
measured test first needs that backend, so an installed plugin costs an unmeasured run nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pytest_vram.backends.base import Backend, BackendUnavailable

__all__ = [
    "BACKENDS",
    "CPU_COUNTERS",
    "REGISTRY",
    "SIM_HOST_TENSORS",
    "Backend",
    "BackendUnavailable",
    "create_backend",
    "resolve_name",
]

#: How the cpu backend counts: ``allocator`` inside PyTorch's CPU allocator (a small library
#: compiled once), ``dispatch`` from Python by watching every op, ``auto`` the first where it
#: can be built.
CPU_COUNTERS = ("auto", "allocator", "dispatch")
#: What the simulated device does with tensors made without a device: counts them as its own
#: (``device``), or leaves them on the host, as a GPU does (``host``).
SIM_HOST_TENSORS = ("device", "host")


def _cuda(**options: Any) -> Backend:
    from pytest_vram.backends.cuda.backend import CudaBackend
    from pytest_vram.backends.cuda.device import local_device_index

    # Under torchrun each rank measures its own device, LOCAL_RANK.
    return CudaBackend(local_device_index())


def _cpu(**options: Any) -> Backend:
    from pytest_vram.backends.cpu.backend import CpuBackend

    return CpuBackend(counter=options.get("cpu_counter") or "auto")


def _sim(**options: Any) -> Backend:
    from pytest_vram.backends.sim.backend import SimBackend

    return SimBackend(
        capacity=options.get("sim_capacity"),
        gpu=options.get("sim_gpu"),
        workspaces=True,
        host_tensors=options.get("sim_host_tensors") or "device",
    )


#: Each backend's name and the factory that imports and makes it.
REGISTRY: dict[str, Callable[..., Backend]] = {"cuda": _cuda, "cpu": _cpu, "sim": _sim}
#: What ``--vram-backend`` accepts.
BACKENDS = ("auto", *REGISTRY)


def resolve_name(name: str) -> str:
    """``auto`` is ``cuda`` where a GPU is available, else the simulated device."""
    if name == "auto":
        import torch

        return "cuda" if torch.cuda.is_available() else "sim"
    return name


def create_backend(name: str, **options: Any) -> Backend:
    """A new backend; raise :class:`BackendUnavailable` when it cannot run here.

    ``options``: ``cpu_counter`` for cpu, ``sim_capacity``, ``sim_gpu`` and
    ``sim_host_tensors`` for sim; others are ignored.
    """
    name = resolve_name(name)
    factory = REGISTRY.get(name)
    if factory is None:
        raise BackendUnavailable(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")
    return factory(**options)
