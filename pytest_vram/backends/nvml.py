"""NVML as a memory source: an NVIDIA GPU's (or MIG slice's) used memory.

Optional: without the driver library or the ``pynvml`` module, :func:`open_source` raises
:class:`~pytest_vram.backends.sampler.SourceUnavailable` saying why.
"""

from __future__ import annotations

import os
from typing import Any

from pytest_vram.backends.sampler import SourceUnavailable

__all__ = ["NvmlSource", "open_source", "visible_mig_uuid"]


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

    def used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)

    def driver_version(self) -> str | None:
        return _text(self._nvml.nvmlSystemGetDriverVersion())

    def close(self) -> None:
        """NVML stays initialised: other code in the process may be using it."""


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
        handle = _handle_for(pynvml, device_index)
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        raise SourceUnavailable(f"NVML could not be initialised: {exc}") from None
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


def _handle_for(pynvml: Any, device_index: int) -> Any:
    # CUDA_VISIBLE_DEVICES renumbers devices for CUDA but not for NVML; a UUID is the same
    # for both. CUDA reports a MIG slice's UUID without saying it is one, so try both forms.
    candidates = []
    visible = visible_mig_uuid(device_index)
    if visible is not None and not visible.startswith("MIG-GPU-"):  # not the pre-R470 form
        candidates.append(visible)
    import torch

    uuid = getattr(torch.cuda.get_device_properties(device_index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        if text.startswith(("GPU-", "MIG-")):
            candidates.append(text)
        else:
            candidates += [f"GPU-{text}", f"MIG-{text}"]
    for candidate in candidates:
        try:
            return pynvml.nvmlDeviceGetHandleByUUID(candidate)
        except Exception:
            continue
    return pynvml.nvmlDeviceGetHandleByIndex(device_index)


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
