"""Fake GPU surfaces for tests on CPU-only machines: torch.cuda, pynvml and amdsmi.

``fake_cuda`` replaces torch.cuda's memory and device functions with a small allocator model
over a list of GPUs (one H100 unless a test adds more); ``fake_nvml`` and ``fake_amdsmi`` put
fake management libraries in ``sys.modules``. The fixtures live in fake_gpu_fixtures.py, which
test modules load with ``pytest_plugins``.

The fakes answer as the real APIs do where the backend depends on it: a CUDA context and a
cuBLAS handle cost device memory that NVML sees and the allocator does not; NVML's v1 memory
struct counts the driver's reserve as used and v2 reports it apart; NVML numbers GPUs in PCI
order and finds them by UUID or PCI bus id; PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync
has no history and no native counters; a device-side assert makes every later device call
fail.
"""

from __future__ import annotations

import os
import sys
import threading
import types
from types import SimpleNamespace
from typing import Any, ClassVar

import torch

KiB = 1024
GiB = 1024**3
MiB = 1024**2
H100 = "NVIDIA H100 80GB HBM3"
UUID = "8f2c4d1e-0b6a-4c5e-9d7f-2a1b3c4d5e6f"
SEGMENT = 2 * MiB
#: What a CUDA context costs on the device: NVML counts it, the allocator does not.
CUDA_CONTEXT = 512 * MiB
#: What making a cuBLAS handle costs on the device besides its workspace.
CUBLAS_HANDLE = 64 * MiB
#: The cuBLAS workspace a handle takes from the caching allocator (Hopper's default).
CUBLAS_WORKSPACE = 32 * MiB
#: What the driver keeps for itself: NVML's v1 struct counts it as used, v2 apart.
DRIVER_RESERVE = 512 * MiB
#: The message of a CUDA error after a device-side assert, as torch raises it.
DEVICE_ASSERT = (
    "CUDA error: device-side assert triggered\n"
    "CUDA kernel errors might be asynchronously reported at some other API call, so the "
    "stacktrace below might be incorrect.\n"
    "For debugging consider passing CUDA_LAUNCH_BLOCKING=1"
)
#: What torch raises for a CUDA error: torch.AcceleratorError (a RuntimeError) since torch
#: 2.8, a plain RuntimeError before.
CudaError: type[RuntimeError] = getattr(torch, "AcceleratorError", RuntimeError)


def gpu(
    name: str = H100, total: int = 80 * GiB, uuid: str | None = UUID, bus: int | None = 0x18,
    **more: Any,
) -> SimpleNamespace:  # fmt: skip
    """What torch.cuda.get_device_properties answers for one device; ``bus`` None: torch
    gives no PCI address."""
    pci = {"pci_bus_id": bus, "pci_domain_id": 0, "pci_device_id": 0} if bus is not None else {}
    return SimpleNamespace(name=name, total_memory=total, uuid=uuid, **{**pci, **more})


def bus_id(properties: Any) -> str | None:
    """A device's PCI bus id as NVML spells it, from its torch properties."""
    bus = getattr(properties, "pci_bus_id", None)
    if bus is None:
        return None
    domain = getattr(properties, "pci_domain_id", 0)
    return f"{domain:08X}:{bus:02X}:{getattr(properties, 'pci_device_id', 0):02X}.0"


def _same_bus(a: str, b: str) -> bool:
    # NVML accepts its ids in any case, with a 4- or 8-digit domain.
    def parts(text: str) -> list[int]:
        return [int(p, 16) for p in text.replace(".", ":").split(":")]

    try:
        return parts(a) == parts(b)
    except ValueError:
        return False


def allocator_backend() -> str:
    """What torch.cuda.get_allocator_backend answers, from the variables torch reads."""
    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        conf = os.environ.get(name)
        if conf:
            settings = dict(
                item.split(":", 1) for item in conf.replace(" ", "").split(",") if ":" in item
            )
            return settings.get("backend", "native")
    return "native"


class FakeAllocator:
    """The caching allocator's figures: blocks come from 2 MiB segments it keeps until emptied.

    It also keeps what the driver sees besides: each device's CUDA context and cuBLAS handle,
    and whether a device-side assert has made the context unusable.
    """

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
        #: The devices with a CUDA context, and with a cuBLAS handle.
        self.contexts: set[int] = set()
        self.blas_handles: set[int] = set()
        #: Bytes of cuBLAS workspace held as allocated blocks.
        self.workspace = 0
        #: The error every device call raises once a kernel's assert fired.
        self.lost: str | None = None
        #: The allocator's history: its settings while recorded, and its trace.
        self.recording: dict[str, Any] | None = None
        self.trace: list[dict[str, Any]] = []
        self.history_calls: list[dict[str, Any]] = []

    # -- the device ---------------------------------------------------------------------

    def device_call(self, index: int | None = None) -> int:
        """A call that reaches the device: it makes the context, and fails once it is lost."""
        index = self.current if index is None else index
        if self.lost is not None:
            raise CudaError(self.lost)
        self.contexts.add(index)
        return index

    def device_assert(self) -> None:
        """A kernel whose assert fires: the launch returns, and every device call after it
        fails (the error is sticky)."""
        self.device_call()
        self.lost = DEVICE_ASSERT

    def usage(self, index: int) -> int:
        """What the driver sees in use on torch's device ``index`` for this process."""
        used = CUDA_CONTEXT if index in self.contexts else 0
        used += CUBLAS_HANDLE if index in self.blas_handles else 0
        return used + (self.reserved if index == self.current else 0)

    def usage_for(self, uuid: str | None = None, bus: str | None = None) -> int:
        """What this process uses on the GPU NVML knows by ``uuid`` or PCI ``bus`` id."""
        for index, properties in enumerate(self.gpus):
            mine = str(properties.uuid) if properties.uuid is not None else None
            ours = bus_id(properties)
            if (uuid and mine and uuid in (mine, f"GPU-{mine}", f"MIG-{mine}")) or (
                bus and ours and _same_bus(bus, ours)
            ):
                return self.usage(index)
        return 0

    def current_blas_handle(self) -> int:
        """torch.cuda.current_blas_handle, as a first matmul makes it: the handle, and its
        workspace from the caching allocator."""
        index = self.device_call()
        if index not in self.blas_handles:
            self.blas_handles.add(index)
        if self.workspace == 0:
            self.malloc(CUBLAS_WORKSPACE)
            self.workspace = CUBLAS_WORKSPACE
        return 0x5EED0000 + index

    def clear_workspaces(self) -> None:
        self.calls.append("clear_cublas_workspaces")
        self.free(self.workspace)
        self.workspace = 0

    # -- the allocator ------------------------------------------------------------------

    def malloc(self, nbytes: int) -> None:
        self.device_call()
        self.allocated += nbytes
        if self.allocated > self.reserved:
            self.reserved = -(-self.allocated // SEGMENT) * SEGMENT
        self.peak_allocated = max(self.peak_allocated, self.allocated)
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self._record({"action": "alloc", "size": nbytes})

    def free(self, nbytes: int) -> None:
        self.allocated -= nbytes
        if nbytes:
            self._record({"action": "free_completed", "size": nbytes})

    def empty_cache(self) -> None:
        self.device_call()
        self.calls.append("empty_cache")
        self.reserved = -(-self.allocated // SEGMENT) * SEGMENT

    def synchronize(self, device: Any = None) -> None:
        self.device_call(self.seen(device))
        self.calls.append("synchronize")

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
        if index >= len(self.gpus):
            raise CudaError("CUDA error: invalid device ordinal")
        self.device_call(index)  # CUDA 12 makes the context here
        self.set_device_calls.append(index)
        self.current = index

    # -- history and snapshots, as torch.cuda.memory has them ---------------------------

    @property
    def asynchronous(self) -> bool:
        return allocator_backend() == "cudaMallocAsync"

    def record_memory_history(
        self,
        enabled: str | None = "all",
        context: str | None = "all",
        stacks: str = "all",
        max_entries: int = sys.maxsize,
        device: Any = None,
        clear_history: bool = False,
        compile_context: bool = False,
        global_record_annotations: bool = False,
        skip_actions: list[str] | None = None,
    ) -> None:
        if self.asynchronous:
            raise RuntimeError(
                "cudaMallocAsync does not yet support recordHistory. If you need it, please "
                "file an issue describing your use case."
            )
        self.history_calls.append(
            {"enabled": enabled, "stacks": stacks, "max_entries": max_entries,
             "clear_history": clear_history}
        )  # fmt: skip
        if enabled is None or clear_history:  # as the allocator does: off drops the trace
            self.trace.clear()
        self.recording = None if enabled is None else {"stacks": stacks, "max_entries": max_entries}

    def snapshot(self, device: Any = None, augment_with_fx_traces: bool = False) -> dict:
        if self.asynchronous:
            raise RuntimeError(
                "Calling snapshot with backend:cudaMallocAsync is not meaningful. (For "
                "backend:native, snapshot returns a detailed summary of all blocks tracked by "
                "the allocator, but the cudaMallocAsync backend does not track individual "
                "blocks.)"
            )
        return {
            "segments": [{"device": self.current, "total_size": self.reserved, "blocks": []}],
            "device_traces": [list(self.trace)],
        }

    def _record(self, entry: dict[str, Any]) -> None:
        if self.recording is None:
            return
        self.trace.append(entry)
        del self.trace[: -self.recording["max_entries"]]


class NVMLError(Exception):
    """pynvml's error: ``value`` is the NVML return code."""

    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return FakeNvml.ERRORS.get(self.value, "Unknown Error")


def nvml_gpu(
    uuid: str, bus: str, used: int = 0, name: str = H100, total: int = 80 * GiB
) -> SimpleNamespace:
    """One GPU as NVML knows it: ``used`` is what other processes use on it."""
    return SimpleNamespace(uuid=uuid, bus=bus, used=used, name=name, total=total)


class FakeNvml(types.ModuleType):
    """pynvml with one GPU whose used memory the test sets, and optionally MIG slices of it;
    or with ``gpus``, several GPUs in NVML's own (PCI) order.

    A reading adds what the linked FakeAllocator's process uses on the GPU (its context,
    cuBLAS handle and reserved segments), found by UUID or PCI bus id as the driver knows it.
    """

    NVML_DEVICE_MIG_ENABLE = 1
    NVML_ERROR_NOT_SUPPORTED = 3
    NVML_ERROR_NOT_FOUND = 6
    NVML_ERROR_FUNCTION_NOT_FOUND = 13
    NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
    ERRORS: ClassVar[dict[int, str]] = {
        3: "Not Supported",
        6: "Not Found",
        13: "Function Not Found",
        25: "Argument version mismatch",
    }
    nvmlMemory_v2 = 0x02000028
    NVMLError = NVMLError

    def __init__(self, used: int = 1 * GiB, total: int = 80 * GiB) -> None:
        super().__init__("pynvml")
        self.used = used
        self.total = total
        self.name = H100
        #: The process whose usage the readings add, None: none.
        self.alloc: FakeAllocator | None = None
        #: Several GPUs, in NVML's order; None: one GPU that any UUID (``gpu_uuids``) or
        #: PCI bus id names.
        self.gpus: list[SimpleNamespace] | None = None
        #: What the driver reserves on each GPU: in v1's used, apart in v2.
        self.reserve = DRIVER_RESERVE
        #: The NVML error a v2 memory read answers, None: the driver has v2.
        self.v2_error: int | None = None
        self.init_error: Exception | None = None
        self.uuid_error: Exception | None = None
        self.read_error: Exception | None = None
        self.handles: list[tuple[str, object]] = []
        self.reads: list[str] = []
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
        if self.gpus is not None:
            for position, known in enumerate(self.gpus):
                if known.uuid == uuid:
                    self.handles.append(("uuid", uuid))
                    return ("gpu", position)
            raise NVMLError(self.NVML_ERROR_NOT_FOUND)
        if not uuid.startswith("GPU-") or (
            self.gpu_uuids is not None and uuid not in self.gpu_uuids
        ):
            raise NVMLError(self.NVML_ERROR_NOT_FOUND)
        self.handles.append(("uuid", uuid))
        return ("handle", uuid)

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> object:
        if self.gpus is not None:
            for position, known in enumerate(self.gpus):
                if _same_bus(known.bus, bus):
                    self.handles.append(("bus", bus))
                    return ("gpu", position)
            raise NVMLError(self.NVML_ERROR_NOT_FOUND)
        self.handles.append(("bus", bus))
        return ("bus", bus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> object:
        self.handles.append(("index", index))
        return ("gpu", index) if self.gpus is not None else ("handle", index)

    def nvmlDeviceIsMigDeviceHandle(self, handle: Any) -> bool:
        return handle[0] == "mig"

    def nvmlDeviceGetMigMode(self, handle: Any) -> list[int]:
        if self.mig_mode is None:
            raise NVMLError(self.NVML_ERROR_NOT_SUPPORTED)
        return [self.mig_mode, self.mig_mode]

    def nvmlDeviceGetName(self, handle: Any) -> bytes:
        if handle[0] == "mig":
            return self.slices[handle[1]]["name"].encode()
        if handle[0] == "gpu":
            return self.gpus[handle[1]].name.encode()  # type: ignore[index]
        return self.name.encode()

    def nvmlDeviceGetMemoryInfo(self, handle: Any, version: int | None = None) -> Any:
        if self.read_error is not None:
            raise self.read_error
        if version is not None and self.v2_error is not None:
            raise NVMLError(self.v2_error)
        if version is not None and version != self.nvmlMemory_v2:
            raise NVMLError(self.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)
        self.reads.append("v1" if version is None else "v2")
        used, total = self._used(handle)
        reserve = 0 if handle[0] == "mig" else self.reserve
        if version is None:  # v1: the reserve counts as used
            return SimpleNamespace(used=used + reserve, total=total, free=total - used - reserve)
        return SimpleNamespace(
            version=version, total=total, reserved=reserve, free=total - used - reserve, used=used
        )

    def _used(self, handle: Any) -> tuple[int, int]:
        kind, key = handle
        process = self.alloc
        if kind == "mig":
            piece = self.slices[key]
            mine = process.usage_for(uuid=key) if process is not None else 0
            return piece["used"] + mine, piece["total"]
        if kind == "gpu":
            known = self.gpus[key]  # type: ignore[index]
            mine = process.usage_for(uuid=known.uuid, bus=known.bus) if process else 0
            return known.used + mine, known.total
        used = self.used
        if self.spike is not None:
            # One reading at the spike, then memory falls back.
            used, self.spike = self.spike, None
            self.spike_thread = threading.current_thread().name
            self.spike_served.set()
        if process is not None:
            used += process.usage_for(
                uuid=key if kind == "handle" else None, bus=key if kind == "bus" else None
            )
        return used, self.total

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
