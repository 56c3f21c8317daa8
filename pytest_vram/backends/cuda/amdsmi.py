"""amdsmi as a memory source: an AMD GPU's used VRAM under ROCm.

ROCm's ``amdsmi`` Python package ships with ROCm (not on PyPI for every release), so it is
optional: without it, or without the library it wraps, :func:`open_source` raises
:class:`~pytest_vram.backends.cuda.source.SourceUnavailable` saying why.
"""

from __future__ import annotations

from typing import Any

from pytest_vram.backends.cuda.source import SourceUnavailable, pci_address

__all__ = ["AmdSmiSource", "open_source"]

MiB = 1024 * 1024


class AmdSmiSource:
    """Reads one AMD GPU's used VRAM through an amdsmi processor handle."""

    name = "amdsmi"
    mig = False
    device_name: str | None = None

    def __init__(self, amdsmi: Any, handle: Any) -> None:
        self._amdsmi = amdsmi
        self._handle = handle
        vram = getattr(getattr(amdsmi, "AmdSmiMemoryType", None), "VRAM", None)
        # amdsmi_get_gpu_memory_usage answers in bytes; amdsmi_get_gpu_vram_usage in whole
        # MB, so it is only the fallback of older releases.
        if vram is not None and hasattr(amdsmi, "amdsmi_get_gpu_memory_usage"):
            self._vram_type = vram
        else:
            self._vram_type = None

    def used(self) -> int:
        if self._vram_type is not None:
            return int(self._amdsmi.amdsmi_get_gpu_memory_usage(self._handle, self._vram_type))
        return int(self._amdsmi.amdsmi_get_gpu_vram_usage(self._handle)["vram_used"]) * MiB

    def driver_version(self) -> str | None:
        try:
            info = self._amdsmi.amdsmi_get_gpu_driver_info(self._handle)
        except Exception:
            return None
        version = info.get("driver_version") if isinstance(info, dict) else None
        return str(version) if version else None

    def close(self) -> None:
        """amdsmi stays initialised: other code in the process may be using it."""


def open_source(device_index: int) -> AmdSmiSource:
    """The source for the ROCm device ``device_index``; raise SourceUnavailable otherwise."""
    try:
        import amdsmi
    except ImportError:
        raise SourceUnavailable(
            "the amdsmi module (ROCm's amd-smi Python package) is not installed"
        ) from None
    try:
        flags = getattr(getattr(amdsmi, "AmdSmiInitFlags", None), "INIT_AMD_GPUS", None)
        if flags is None:
            amdsmi.amdsmi_init()
        else:
            amdsmi.amdsmi_init(flags)
        handles = list(amdsmi.amdsmi_get_processor_handles())
    except Exception as exc:  # AmdSmiLibraryException: no driver, no library
        raise SourceUnavailable(f"amdsmi could not be initialised: {exc}") from None
    return AmdSmiSource(amdsmi, _handle_for(amdsmi, handles, device_index))


def _handle_for(amdsmi: Any, handles: list[Any], device_index: int) -> Any:
    # HIP_VISIBLE_DEVICES and ROCR_VISIBLE_DEVICES renumber devices for torch but not for
    # amdsmi; the PCI address is the same for both. amdsmi's device at torch's index may be
    # another GPU, so without an address one is read only where both see one GPU alone.
    import torch

    bdf = _torch_bdf(device_index)
    if bdf is not None:
        for handle in handles:
            try:
                theirs = str(amdsmi.amdsmi_get_gpu_device_bdf(handle)).lower()
            except Exception:
                continue
            if theirs.split(".")[0] == bdf:
                return handle
        raise SourceUnavailable(
            f"amdsmi lists {len(handles)} GPUs and none at ROCm device {device_index}'s PCI "
            f"address {bdf}: the device figure is not checked"
        )
    count = torch.cuda.device_count()
    if len(handles) == 1 and count == 1:
        return handles[0]
    raise SourceUnavailable(
        f"torch gives no PCI address for ROCm device {device_index}; it sees {count} GPUs and "
        f"amdsmi lists {len(handles)}, whose numbering need not be torch's: the device figure "
        "is not checked"
    )


def _torch_bdf(device_index: int) -> str | None:
    """``domain:bus:device`` of a torch device, as amdsmi spells it before the function."""
    import torch

    address = pci_address(torch.cuda.get_device_properties(device_index))
    if address is None:
        return None
    domain, bus, device = address
    return f"{domain:04x}:{bus:02x}:{device:02x}"
