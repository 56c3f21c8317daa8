"""NVML as a memory source: an NVIDIA GPU's (or MIG slice's) used memory.

Optional: without the driver library or the ``pynvml`` module, :func:`open_source` raises
:class:`~pytest_vram.backends.cuda.source.SourceUnavailable` saying why.
"""

from __future__ import annotations

import os
from typing import Any

from pytest_vram.backends.cuda.source import SourceUnavailable, pci_address

__all__ = ["NvmlSource", "nvml_bus_id", "open_source", "visible_mig_uuid"]

# What a driver without the v2 memory struct answers for it.
_NO_V2 = (
    "NVML_ERROR_FUNCTION_NOT_FOUND",
    "NVML_ERROR_ARGUMENT_VERSION_MISMATCH",
    "NVML_ERROR_NOT_SUPPORTED",
)


class NvmlSource:
    """Reads one device handle: a whole GPU, or a MIG slice's own handle."""

    name = "nvml"

    def __init__(
        self, nvml: Any, handle: Any, *, mig: bool = False, device_name: str | None = None
    ) -> None:
        self._nvml = nvml
        self._handle = handle
        self.mig = mig
        self.device_name = device_name
        #: The memory struct read: ``v2`` where the driver has it, else ``v1``.
        self.struct = "v2" if getattr(nvml, "nvmlMemory_v2", None) is not None else "v1"

    def used(self) -> int:
        nvml = self._nvml
        if self.struct == "v2":
            # v1's used counts the driver's reserve too (hundreds of MiB on an idle GPU);
            # v2 reports it apart.
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(self._handle, version=nvml.nvmlMemory_v2)
                return int(info.used)
            except Exception as exc:
                if not _lacks_v2(nvml, exc):
                    raise
                self.struct = "v1"
        return int(nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def driver_version(self) -> str | None:
        return _text(self._nvml.nvmlSystemGetDriverVersion())

    def close(self) -> None:
        """NVML stays initialised: other code in the process may be using it."""


def _lacks_v2(nvml: Any, exc: Exception) -> bool:
    codes = {getattr(nvml, name, None) for name in _NO_V2} - {None}
    return getattr(exc, "value", None) in codes


def open_source(device_index: int) -> NvmlSource:
    """The source for the CUDA device ``device_index``; raise SourceUnavailable otherwise."""
    try:
        import pynvml
    except ImportError:
        raise SourceUnavailable(
            "the pynvml module (package nvidia-ml-py) is not installed"
        ) from None
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise SourceUnavailable(f"NVML could not be initialised: {exc}") from None
    handle = _handle_for(pynvml, device_index)
    if _is_mig_device(pynvml, handle):
        return NvmlSource(pynvml, handle, mig=True, device_name=_device_name(pynvml, handle))
    if _mig_enabled(pynvml, handle):
        # The parent GPU's figures are all its slices' together: not this test's device.
        raise SourceUnavailable(
            f"CUDA device {device_index} is a MIG slice and NVML cannot tell which: set "
            "CUDA_VISIBLE_DEVICES to the slice's MIG- UUID (nvidia-smi -L lists them)",
            mig=True,
        )
    return NvmlSource(pynvml, handle)


def visible_mig_uuid(device_index: int) -> str | None:
    """The ``MIG-`` UUID that CUDA_VISIBLE_DEVICES gives the CUDA device ``device_index``."""
    entries = [e.strip() for e in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
    if device_index < len(entries) and entries[device_index].startswith("MIG-"):
        return entries[device_index]
    return None


def nvml_bus_id(properties: Any) -> str | None:
    """The PCI bus id of a device, as NVML spells it (``00000000:3B:00.0``), from
    ``torch.cuda.get_device_properties``; None where torch does not say."""
    address = pci_address(properties)
    if address is None:
        return None
    domain, bus, device = address
    return f"{domain:08X}:{bus:02X}:{device:02X}.0"


def _handle_for(pynvml: Any, device_index: int) -> Any:
    # Never NVML's device at the CUDA index: CUDA_VISIBLE_DEVICES renumbers devices for CUDA
    # and not for NVML, and CUDA_DEVICE_ORDER=FASTEST_FIRST (CUDA's default) need not be
    # NVML's PCI order. A UUID or a PCI bus id is the same for both.
    import torch

    properties = torch.cuda.get_device_properties(device_index)
    uuids = _uuids(device_index, properties)
    for uuid in uuids:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(uuid)
        except Exception:
            continue
    bus = nvml_bus_id(properties)
    if bus is not None:
        try:
            return pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        except Exception:
            pass
    known = [f"UUID {u}" for u in uuids[:1]] + ([f"PCI bus id {bus}"] if bus else [])
    raise SourceUnavailable(
        f"NVML has no device with CUDA device {device_index}'s "
        + (" or ".join(known) if known else "UUID or PCI bus id (torch gives neither)")
        + ", and NVML's numbering need not be CUDA's: the device figure is not checked"
    )


def _uuids(device_index: int, properties: Any) -> list[str]:
    # CUDA reports a MIG slice's UUID without saying it is one, so try both forms.
    candidates = []
    visible = visible_mig_uuid(device_index)
    if visible is not None and not visible.startswith("MIG-GPU-"):  # not the pre-R470 form
        candidates.append(visible)
    uuid = getattr(properties, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        if text.startswith(("GPU-", "MIG-")):
            candidates.append(text)
        else:
            candidates += [f"GPU-{text}", f"MIG-{text}"]
    return candidates


def _is_mig_device(pynvml: Any, handle: Any) -> bool:
    try:
        return bool(pynvml.nvmlDeviceIsMigDeviceHandle(handle))
    except Exception:  # an old binding or driver: no MIG
        return False


def _mig_enabled(pynvml: Any, handle: Any) -> bool:
    try:
        current, _pending = pynvml.nvmlDeviceGetMigMode(handle)
    except Exception:  # NVML_ERROR_NOT_SUPPORTED on GPUs without MIG
        return False
    return current == getattr(pynvml, "NVML_DEVICE_MIG_ENABLE", 1)


def _device_name(pynvml: Any, handle: Any) -> str | None:
    try:
        return _text(pynvml.nvmlDeviceGetName(handle))
    except Exception:
        return None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
