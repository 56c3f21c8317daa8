"""Fake GPU surfaces for tests on CPU-only machines: torch.cuda, pynvml and amdsmi.

``fake_cuda`` replaces torch.cuda's memory and device functions with a small allocator model
over a list of GPUs (one H100 unless a test adds more); ``fake_nvml`` and ``fake_amdsmi`` put
fake management libraries in ``sys.modules``. The fixtures live in fake_gpu_fixtures.py, which
test modules load with ``pytest_plugins``.
"""

from __future__ import annotations

import threading
import types
from types import SimpleNamespace
from typing import Any

import torch

GiB = 1024**3
MiB = 1024**2
H100 = "NVIDIA H100 80GB HBM3"
UUID = "8f2c4d1e-0b6a-4c5e-9d7f-2a1b3c4d5e6f"
SEGMENT = 2 * MiB


def gpu(name: str = H100, total: int = 80 * GiB, uuid: str = UUID, **more: Any) -> SimpleNamespace:
    """What torch.cuda.get_device_properties answers for one device."""
    return SimpleNamespace(name=name, total_memory=total, uuid=uuid, **more)


class FakeAllocator:
    """The caching allocator's figures: blocks come from 2 MiB segments it keeps until emptied."""

    def __init__(self) -> None:
        self.allocated = 0
        self.reserved = 0
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.num_ooms = 0
        self.num_alloc_retries = 0
        self.inactive_split = 0
        self.initialised = False
        self.calls: list[str] = []
        self.devices: set[int] = set()
        #: The visible devices, as get_device_properties describes them.
        self.gpus = [gpu()]
        self.current = 0
        self.set_device_calls: list[int] = []

    def malloc(self, nbytes: int) -> None:
        self.allocated += nbytes
        if self.allocated > self.reserved:
            self.reserved = -(-self.allocated // SEGMENT) * SEGMENT
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes

    def empty_cache(self) -> None:
        self.calls.append("empty_cache")
        self.reserved = -(-self.allocated // SEGMENT) * SEGMENT

    def seen(self, device: Any) -> int:
        if device is None:
            index = self.current
        elif isinstance(device, torch.device):
            index = self.current if device.index is None else device.index
        else:
            index = int(device)
        self.devices.add(index)
        return index

    def set_device(self, device: Any) -> None:
        index = self.seen(device)
        self.set_device_calls.append(index)
        self.current = index


class FakeNvml(types.ModuleType):
    """pynvml with one GPU whose used memory the test sets, and optionally MIG slices of it."""

    NVML_DEVICE_MIG_ENABLE = 1

    def __init__(self, used: int = 1 * GiB, total: int = 80 * GiB) -> None:
        super().__init__("pynvml")
        self.used = used
        self.total = total
        self.name = H100
        self.init_error: Exception | None = None
        self.uuid_error: Exception | None = None
        self.read_error: Exception | None = None
        self.handles: list[tuple[str, object]] = []
        self.spike: int | None = None
        self.spike_served = threading.Event()
        self.spike_thread: str | None = None
        #: The GPU UUIDs NVML knows; None: any ``GPU-`` UUID.
        self.gpu_uuids: set[str] | None = None
        #: MIG slices by UUID: their name and used memory.
        self.slices: dict[str, dict[str, Any]] = {}
        #: The parent GPU's current MIG mode; None: a GPU without MIG support.
        self.mig_mode: int | None = None

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> object:
        if self.uuid_error is not None:
            raise self.uuid_error
        if uuid in self.slices:
            self.handles.append(("uuid", uuid))
            return ("mig", uuid)
        if not uuid.startswith("GPU-") or (
            self.gpu_uuids is not None and uuid not in self.gpu_uuids
        ):
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        self.handles.append(("uuid", uuid))
        return ("handle", uuid)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        self.handles.append(("index", index))
        return ("handle", index)

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> bool:
        return handle[0] == "mig"

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        if self.mig_mode is None:
            raise RuntimeError("NVML_ERROR_NOT_SUPPORTED")
        return [self.mig_mode, self.mig_mode]

    def nvmlDeviceGetName(self, handle: Any) -> bytes:
        if handle[0] == "mig":
            return self.slices[handle[1]]["name"].encode()
        return self.name.encode()

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> SimpleNamespace:
        if self.read_error is not None:
            raise self.read_error
        if handle[0] == "mig":
            piece = self.slices[handle[1]]
            return SimpleNamespace(used=piece["used"], total=piece["total"])
        used = self.used
        if self.spike is not None:
            # One reading at the spike, then memory falls back.
            used, self.spike = self.spike, None
            self.spike_thread = threading.current_thread().name
            self.spike_served.set()
        return SimpleNamespace(used=used, total=self.total, free=self.total - used)

    def nvmlSystemGetDriverVersion(self) -> bytes:
        return b"570.124.06"


class FakeAmdSmi(types.ModuleType):
    """amdsmi with AMD GPUs at PCI addresses; used VRAM in bytes per GPU."""

    class AmdSmiMemoryType:
        VRAM = 0
        VIS_VRAM = 1
        GTT = 2

    class AmdSmiInitFlags:
        INIT_AMD_GPUS = 2

    def __init__(self, bdfs: list[str] | None = None, used: int = 2 * GiB) -> None:
        super().__init__("amdsmi")
        self.bdfs = bdfs or ["0000:c1:00.0"]
        self.used = {bdf: used for bdf in self.bdfs}
        self.init_flags: list[Any] = []
        self.init_error: Exception | None = None
        self.queries: list[tuple[str, str]] = []

    def amdsmi_init(self, flags: Any = None) -> None:
        if self.init_error is not None:
            raise self.init_error
        self.init_flags.append(flags)

    def amdsmi_get_processor_handles(self) -> list[tuple[str, str]]:
        return [("amd", bdf) for bdf in self.bdfs]

    def amdsmi_get_gpu_device_bdf(self, handle: tuple[str, str]) -> str:
        return handle[1]

    def amdsmi_get_gpu_memory_usage(self, handle: tuple[str, str], mem_type: int) -> int:
        assert mem_type == self.AmdSmiMemoryType.VRAM
        self.queries.append(("memory_usage", handle[1]))
        return self.used[handle[1]]

    def amdsmi_get_gpu_vram_usage(self, handle: tuple[str, str]) -> dict[str, int]:
        self.queries.append(("vram_usage", handle[1]))
        return {"vram_total": 192 * 1024, "vram_used": self.used[handle[1]] // MiB}

    def amdsmi_get_gpu_driver_info(self, handle: tuple[str, str]) -> dict[str, str]:
        return {"driver_name": "amdgpu", "driver_version": "6.10.5", "driver_date": "2025/01/01"}


def sampler_threads(name: str = "pytest-vram-nvml") -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name == name}
