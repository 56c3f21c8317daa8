"""What a driver's management library offers the sampler: one device's used memory.

A :class:`MemorySource` reads that used memory for one device: NVML on NVIDIA GPUs
(:mod:`pytest_vram.backends.cuda.nvml`), amdsmi on ROCm (:mod:`pytest_vram.backends.cuda.amdsmi`).
Both libraries are optional: where one or its module is missing, opening its source raises
:class:`SourceUnavailable` saying why. This module imports neither, so that each library's module
and the sampler depend on it and not on each other.
"""

from __future__ import annotations

from typing import Any, Protocol

__all__ = ["MemorySource", "SourceUnavailable", "pci_address"]


class SourceUnavailable(Exception):
    """A memory source cannot be opened here; the message says why.

    ``mig`` is True when the library saw that the device is a MIG slice without being able to
    read the slice itself: the device is still named as one.
    """

    def __init__(self, reason: str, *, mig: bool = False) -> None:
        super().__init__(reason)
        self.mig = mig


class MemorySource(Protocol):
    """One device's used memory, as its driver's management library reads it."""

    #: The library's name: ``nvml`` or ``amdsmi`` (it names the sampler's thread).
    name: str
    #: Whether the device is a MIG slice (NVIDIA's Multi-Instance GPU).
    mig: bool
    #: The name the library gives the device (a MIG slice's profile name), None when unknown.
    device_name: str | None

    def used(self) -> int:
        """Bytes in use on the device now."""
        ...

    def driver_version(self) -> str | None: ...

    def close(self) -> None: ...


def pci_address(properties: Any) -> tuple[int, int, int] | None:
    """PCI domain, bus and device of ``torch.cuda.get_device_properties``'s device, by which
    NVML and amdsmi find it whatever their numbering; None where torch does not say."""
    bus = getattr(properties, "pci_bus_id", None)
    if bus is None:
        return None
    domain = getattr(properties, "pci_domain_id", 0) or 0
    device = getattr(properties, "pci_device_id", 0) or 0
    return int(domain), int(bus), int(device)
