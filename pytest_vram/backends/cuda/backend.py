"""The real device: the PyTorch caching allocator's statistics, and the driver's view of the
device (NVML on NVIDIA GPUs, amdsmi on ROCm) where its library loads.

One class serves a fleet: under pytest-xdist each worker takes its own GPU, under torchrun each
rank its LOCAL_RANK's, a MIG slice is named (and baselined) as the slice, and a ROCm build of
torch is recorded as HIP.

The device figure is what the device holds above its floor: what it held once the backend was
ready (CUDA context made, one cuBLAS handle made, caches emptied). Without the floor the first
test on a device would pay for the context and the handle, several hundred MiB, and its figure
would depend on which test ran first.
"""

from __future__ import annotations

import operator
import os
import re
from typing import Any, NoReturn

import torch

from pytest_vram.backends.base import Backend, BackendUnavailable
from pytest_vram.backends.cuda.history import stop_history
from pytest_vram.backends.cuda.nvml import visible_mig_uuid
from pytest_vram.backends.cuda.resets import ACCUMULATED, ResetWrappers, unwrapped
from pytest_vram.backends.cuda.sampler import MemorySampler
from pytest_vram.backends.cuda.source import SourceUnavailable
from pytest_vram.backends.keptpeaks import KeptPeaks
from pytest_vram.units import format_size

__all__ = [
    "ALLOC_CONF_VARIABLES",
    "WORKER_GPUS",
    "CudaBackend",
    "context_lost",
    "open_device_sampler",
    "worker_device_index",
]

#: The environment variable that chooses how pytest-xdist workers pick their GPU: ``spread``
#: (the default: worker gwN takes device N modulo the device count) or ``current`` (leave
#: the current device as it is, for workers pinned some other way).
WORKER_GPUS = "PYTEST_VRAM_WORKER_GPUS"

#: Where the allocator's settings come from, first found first: PyTorch's current name, then
#: the older ones it still reads.
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")

# Allocator counters that only grow; the test's figure is the difference over the test.
_COUNTERS = {"num_ooms": "num_ooms", "num_alloc_retries": "num_alloc_retries"}

# The CUDA (and HIP) errors after which the context is unusable until the process ends, as
# cudaGetErrorString words them, and their codes.
_LOST_CONTEXT = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "an illegal instruction was encountered",
    "misaligned address",
    "unspecified launch failure",
    "the launch timed out and was terminated",
    "hardware stack error",
    "invalid program counter",
    "uncorrectable ecc error encountered",
    "operation not supported on global/shared address space",
)
_LOST_CONTEXT_CODES = frozenset({214, 700, 702, 710, 714, 715, 716, 717, 718, 719})


def worker_device_index(
    device_count: int, worker: str | None = None, policy: str | None = None
) -> int | None:
    """The GPU a pytest-xdist worker takes: ``gwN`` takes device N modulo ``device_count``.

    None outside pytest-xdist, or when ``policy`` (default: ``$PYTEST_VRAM_WORKER_GPUS``) is
    ``current``. ``worker`` defaults to ``$PYTEST_XDIST_WORKER``, which pytest-xdist sets in
    each worker to its id.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "") if worker is None else worker
    policy = os.environ.get(WORKER_GPUS, "spread") if policy is None else policy
    policy = policy.strip().lower() or "spread"
    if policy not in ("spread", "current"):
        raise BackendUnavailable(f"{WORKER_GPUS}={policy!r}: expected spread or current")
    match = re.fullmatch(r"gw(\d+)", worker)
    if policy == "current" or match is None or device_count < 1:
        return None
    return int(match.group(1)) % device_count


def context_lost(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) is a CUDA error after which the
    process's CUDA context is unusable: a device-side assert, an illegal memory access."""
    seen = 0
    while exc is not None and seen < 10:  # a chain, not a cycle
        if isinstance(exc, RuntimeError):  # torch.AcceleratorError is one
            if getattr(exc, "error_code", None) in _LOST_CONTEXT_CODES:
                return True
            text = str(exc).lower()
            if any(words in text for words in _LOST_CONTEXT):
                return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def open_device_sampler(
    device_index: int, *, rocm: bool = False
) -> tuple[MemorySampler | None, str | None, bool]:
    """A sampler for the torch device ``device_index``: ``(sampler, reason, mig)``.

    NVML reads an NVIDIA GPU, amdsmi an AMD one (``rocm``). Without a sampler, ``reason``
    says why device-level figures are not measured; ``mig`` tells whether the device was
    seen to be a MIG slice either way.
    """
    if rocm:
        from pytest_vram.backends.cuda import amdsmi as library
    else:
        from pytest_vram.backends.cuda import nvml as library  # type: ignore[no-redef]
    try:
        source = library.open_source(device_index)
    except SourceUnavailable as exc:
        return None, str(exc), exc.mig
    return MemorySampler(source), None, source.mig


def _alloc_conf() -> tuple[str, str] | None:
    """The variable that configures the allocator and its value, None when none is set."""
    for name in ALLOC_CONF_VARIABLES:
        value = os.environ.get(name)
        if value:
            return name, value
    return None


def _current_test() -> str | None:
    """The node id of the test pytest is running (it says so in the environment)."""
    running = os.environ.get("PYTEST_CURRENT_TEST")
    return running.rsplit(" (", 1)[0] if running else None


class CudaBackend(Backend):
    """Allocated and reserved bytes from ``torch.cuda.memory_stats`` on one device: ``index``
    (under torchrun, LOCAL_RANK's), else this pytest-xdist worker's GPU, else the current
    device. A chosen device is made the current one, so that a test's ``device="cuda"``
    lands on it."""

    name = "cuda"
    # The real allocator's segments and the device's used memory include what other tests'
    # fixtures hold and what the allocator keeps for them: they depend on which tests ran.
    order_dependent_figures = frozenset({"peak_reserved", "peak_device"})
    is_cuda_device = True
    memory_history = True
    # The allocator's statistics name no storage: attribution pushes a tracker of its own.
    # A C attribute read from C: Tensor.device builds a new object on every read.
    attribution_filter = operator.attrgetter("is_cuda")

    def __init__(self, index: int | None = None) -> None:
        if not torch.cuda.is_available():
            raise BackendUnavailable(
                "the cuda backend needs a CUDA GPU, and torch.cuda.is_available() is False here "
                f"(torch {torch.__version__}, built with CUDA {torch.version.cuda}); "
                "use --vram-backend=auto, cpu or sim on machines without one"
            )
        # max_memory_allocated() quietly answers 0 until CUDA is initialised.
        torch.cuda.init()
        if index is None:
            index = worker_device_index(torch.cuda.device_count())
        if index is None:
            index = torch.cuda.current_device()
        else:
            torch.cuda.set_device(index)
        self.index = index
        self.device = torch.device("cuda", self.index)
        #: A ROCm build: HIP under torch.cuda's names, amdsmi for the device's used memory.
        self.rocm = bool(getattr(torch.version, "hip", None))
        #: The allocator behind torch.cuda: ``native`` (the caching allocator) or
        #: ``cudaMallocAsync``, as PYTORCH_CUDA_ALLOC_CONF chose.
        self.allocator = _allocator_backend()
        #: ``(variable, value)`` of the allocator's settings, None when none are set.
        self.alloc_conf = _alloc_conf()
        #: Set once a CUDA error has made the context unusable: which test, and the error.
        self._lost: tuple[str | None, str] | None = None
        #: The measured test last begun on this backend.
        self._test: str | None = None
        self._warm_up()
        self._sampler, self._sampler_note, mig = open_device_sampler(self.index, rocm=self.rocm)
        #: The device's used memory once the backend was ready: the device figure's zero.
        self.device_floor: int | None = None
        if self._sampler is not None:
            try:
                self.device_floor = self._sampler.used()
            except Exception as exc:  # the library opened but cannot read this device
                self._sampler.close()
                self._sampler = None
                self._sampler_note = f"{self._library()} cannot read the device: {exc}"
        name = torch.cuda.get_device_name(self.index)
        #: Whether the device is a MIG slice; its device class then names the slice.
        self.mig = bool(
            mig
            or " MIG " in f" {name} "
            or (not self.rocm and visible_mig_uuid(self.index) is not None)
        )
        self._device_class = self._slice_name(name) if self.mig else name
        self._counters_at_start: dict[str, int] = {}
        #: The peaks the test's own torch.cuda.reset_peak_memory_stats() would have lost.
        self._kept = KeptPeaks()
        self._resets = ResetWrappers(self._before_reset)

    def _warm_up(self) -> None:
        """Make what the first test on the device would otherwise pay for: the CUDA context
        and a cuBLAS handle (what a first matmul makes); then hand back the workspace and
        cache, so that the floor holds neither."""
        try:
            torch.cuda.current_blas_handle()  # the device is the current one
        except Exception as exc:
            raise BackendUnavailable(
                f"the cuda backend could not make a cuBLAS handle on cuda:{self.index}: "
                f"{_first_line(exc)}"
            ) from None
        self.release_cache()
        torch.cuda.reset_peak_memory_stats(self.index)  # nobody's peak

    def _library(self) -> str:
        return "amdsmi" if self.rocm else "NVML"

    @property
    def device_class(self) -> str:
        return self._device_class

    def _slice_name(self, name: str) -> str:
        """A MIG slice's device class: its profile's name, as NVML or torch gives it."""
        if " MIG " in f" {name} ":
            return name
        named = self._sampler.source.device_name if self._sampler is not None else None
        if named and "MIG" in named:
            return named  # "NVIDIA A100-SXM4-80GB MIG 1g.10gb"
        # Without NVML the slice's size tells one profile from another.
        return f"{name} MIG {format_size(self.total_memory() or 0)}"

    @property
    def asynchronous(self) -> bool:
        """Whether CUDA's own pool allocator (``backend:cudaMallocAsync``) stands behind
        torch.cuda: it keeps no segments, counters or history of its own."""
        return self.allocator.endswith("MallocAsync")

    def _async_reason(self, what: str) -> str:
        variable, value = self.alloc_conf or (ALLOC_CONF_VARIABLES[1], "backend:cudaMallocAsync")
        return f"{variable}={value}: the {self.allocator} allocator {what}"

    @property
    def nvml_note(self) -> str | None:
        """Why device-level figures are missing (no NVML, or no amdsmi on ROCm), or None when
        they are sampled."""
        return None if self._sampler is not None else self._sampler_note

    @property
    def unmeasured(self) -> dict[str, str]:
        """Per figure this backend does not measure here (``device``, ``reserved``), why."""
        reasons = {}
        if self.nvml_note:
            reasons["device"] = self.nvml_note
        if self.asynchronous:
            reasons["reserved"] = self._async_reason("keeps no segments of its own")
        return reasons

    @property
    def snapshot_note(self) -> str | None:
        """Why this device's allocator history cannot be recorded, None when it can."""
        if self.asynchronous:
            return self._async_reason("records no allocation history")
        return None

    def total_memory(self) -> int | None:
        return int(torch.cuda.get_device_properties(self.index).total_memory)

    def begin_test(self) -> None:
        self._check_context()
        self._test = _current_test() or self._test
        self._counters_at_start = self._read_counters()
        if self._sampler is not None:
            self._sampler.start()
        self._resets.install()

    def end_test(self) -> None:
        self._resets.uninstall()
        # Errors of kernels still running surface here, in the test that launched them.
        try:
            torch.cuda.synchronize(self.index)
        except Exception as exc:
            if not context_lost(exc):
                raise
            self._note_lost(exc)
        if self._sampler is not None:
            self._sampler.pause()

    def _before_reset(self, name: str, device: Any) -> None:
        """The test's own code resets torch's statistics of ``device``: keep what the reset
        takes from this test's figures."""
        if not self._is_mine(device):
            return
        if name == ACCUMULATED:
            # The counters start again from zero: what they counted so far stays the test's.
            now = self._read_counters()
            for key in _COUNTERS:
                self._counters_at_start[key] = self._counters_at_start.get(key, 0) - now[key]
        else:
            self._kept.keep(self.peak_allocated(), self.peak_reserved())

    def _is_mine(self, device: Any) -> bool:
        if device is None:
            return torch.cuda.current_device() == self.index
        if isinstance(device, int):
            return device == self.index
        try:
            device = torch.device(device)
        except (RuntimeError, TypeError):
            return False  # torch's own call refuses it
        index = torch.cuda.current_device() if device.index is None else device.index
        return device.type == "cuda" and index == self.index

    def storage_bytes(self, tensor: torch.Tensor) -> int | None:
        if tensor.device != self.device:
            return None
        # The caching allocator hands out multiples of 512 bytes.
        return (tensor.untyped_storage().nbytes() + 511) // 512 * 512

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.index))

    def peak_allocated(self) -> int:
        return self._kept.peak_allocated(int(torch.cuda.max_memory_allocated(self.index)))

    def reset_peak(self) -> None:
        self._kept.clear()
        try:
            unwrapped(torch.cuda.reset_peak_memory_stats)(self.index)
        except Exception as exc:
            self._lose(exc)
        if self._sampler is not None:
            self._sampler.reset()

    def reserved(self) -> int | None:
        if self.asynchronous:
            return None
        return int(torch.cuda.memory_reserved(self.index))

    def peak_reserved(self) -> int | None:
        if self.asynchronous:
            return None
        return self._kept.peak_reserved(int(torch.cuda.max_memory_reserved(self.index)))

    def peak_device(self) -> int | None:
        if self._sampler is None or self.device_floor is None:
            return None
        return max(0, self._sampler.peak() - self.device_floor)

    def release_workspaces(self) -> None:
        # The calling thread's workspaces: autograd's own thread keeps its one where PyTorch
        # keeps a map per thread (docs/sim.md, "Known limits").
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            try:
                clear_workspaces()
            except Exception as exc:
                self._lose(exc)

    def release_cache(self) -> None:
        self._check_context()
        try:
            torch.cuda.synchronize(self.index)
            # cuBLAS keeps its workspaces as allocated blocks; free them so that the next
            # test's first matmul is counted in that test, whichever test ran before it.
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()
        except Exception as exc:
            self._lose(exc)

    def release_blocks(self) -> None:
        """Hand the cached blocks back, keeping cuBLAS's workspaces: between benchmark rounds,
        where freeing them would make each round's first matmul pay for a new one."""
        self._check_context()
        try:
            torch.cuda.synchronize(self.index)
            torch.cuda.empty_cache()
        except Exception as exc:
            self._lose(exc)

    def counters(self) -> dict[str, int]:
        if self.asynchronous:  # its stats hold zeros for these: not measured
            return {}
        now = self._read_counters()
        figures = {key: now[key] - self._counters_at_start.get(key, 0) for key in _COUNTERS}
        figures["inactive_split_bytes"] = now["inactive_split_bytes"]
        return figures

    def memory_summary(self) -> str:
        return torch.cuda.memory_summary(self.index, abbreviated=True)

    def explain_error(self, exc: BaseException) -> str | None:
        if not context_lost(exc):
            return None
        self._note_lost(exc, _current_test())
        return (
            f"CUDA error: {_first_line(exc)}. The CUDA context of this process is unusable "
            "from here on: every later test measured on cuda in it fails at setup. " + _RESTART
        )

    def environment(self) -> dict[str, Any]:
        env = super().environment()
        if self.rocm:
            env["hip"] = str(torch.version.hip)
        else:
            env["cuda"] = str(torch.version.cuda)
        env["gpu"] = self.device_class
        env["total_memory"] = self.total_memory()
        if self.mig:
            env["mig"] = True
        # Figures of differently configured allocators differ for that reason alone.
        env["allocator"] = self.allocator
        if self.alloc_conf is not None:
            env["alloc_conf"] = self.alloc_conf[1]
        if self._sampler is not None:
            env["device_memory"] = self._sampler.source.name
            driver = self._sampler.driver_version()
            if driver:
                env["driver"] = driver
        return env

    def close(self) -> None:
        if self._sampler is not None:
            self._sampler.close()
            self._sampler = None
        # The snapshots' history lives in this device's allocator: it ends with the session.
        stop_history()

    # -- a context lost to a CUDA error ---------------------------------------------------

    def _note_lost(self, exc: BaseException, test: str | None = None) -> None:
        if self._lost is None:
            self._lost = (test or self._test, _first_line(exc))

    def _lose(self, exc: BaseException) -> NoReturn:
        """Re-raise ``exc``; a lost context as the one clear failure."""
        if not context_lost(exc):
            raise exc
        self._note_lost(exc)
        raise self._lost_failure() from None

    def _check_context(self) -> None:
        """Fail at once, with one message, once a CUDA error has made the context unusable:
        whatever ran on it now would fail, in clean-up as anywhere, each time differently."""
        if self._lost is not None:
            raise self._lost_failure()

    def _lost_failure(self) -> BaseException:
        import pytest

        assert self._lost is not None
        test, error = self._lost
        since = f"since {test} raised" if test else "since"
        return pytest.fail.Exception(
            f"not run: the CUDA context of this process is unusable {since} a CUDA error "
            f"({error}), and no later test can run on it. " + _RESTART,
            pytrace=False,
        )

    def _read_counters(self) -> dict[str, int]:
        stats = torch.cuda.memory_stats(self.index)
        figures = {key: int(stats.get(stat, 0)) for key, stat in _COUNTERS.items()}
        figures["inactive_split_bytes"] = int(stats.get("inactive_split_bytes.all.current", 0))
        return figures


_RESTART = (
    "Only a new process has a usable context: run the tests after this one in a fresh "
    "process (pytest-xdist replaces a worker that crashes, up to --max-worker-restart)."
)


def _allocator_backend() -> str:
    try:
        return str(torch.cuda.get_allocator_backend())
    except (AttributeError, RuntimeError):  # a torch without the call
        return "native"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
