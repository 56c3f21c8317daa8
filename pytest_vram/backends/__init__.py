"""Backends measure memory; :func:`create_backend` picks one by name."""

from __future__ import annotations

from typing import Any

import torch

from pytest_vram.backends.base import Backend, BackendUnavailable

__all__ = [
    "BACKENDS",
    "CPU_COUNTERS",
    "Backend",
    "BackendUnavailable",
    "create_backend",
    "resolve_name",
]

BACKENDS = ("auto", "cuda", "cpu", "sim")
#: How the cpu backend counts: ``allocator`` inside PyTorch's CPU allocator (a small library
#: compiled once), ``dispatch`` from Python by watching every op, ``auto`` the first where it
#: can be built.
CPU_COUNTERS = ("auto", "allocator", "dispatch")


def resolve_name(name: str) -> str:
    """``auto`` is ``cuda`` where a GPU is available, else the simulated device."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "sim"
    return name


def create_backend(name: str, **options: Any) -> Backend:
    """A new backend; raise :class:`BackendUnavailable` when it cannot run here."""
    name = resolve_name(name)
    if name == "cpu":
        from pytest_vram.backends.cpu import CpuBackend

        return CpuBackend(counter=options.get("cpu_counter") or "auto")
    if name == "cuda":
        from pytest_vram.backends.cuda import CudaBackend

        return CudaBackend()
    if name == "sim":
        from pytest_vram.backends.sim import SimBackend

        return SimBackend(capacity=options.get("sim_capacity"))
    raise BackendUnavailable(f"unknown backend {name!r}: expected one of {', '.join(BACKENDS)}")
