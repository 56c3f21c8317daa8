"""What ``torch.cuda`` (and ``torch.accelerator``) answer while a simulated test runs.

Device queries answer for one CUDA device of the GPU model simulated; memory queries
(``memory_allocated``, ``memory_stats``, ``mem_get_info``...) read the simulated device's
figures (:class:`SimulatedDevice`); streams and events wait for nothing, since nothing is
computed on a device; CUDA's random state is the CPU generator's, which the simulated
device's tensors are drawn from.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.cuda.memory

__all__ = [
    "DEVICE_NAME",
    "NotSimulatedError",
    "SimulatedDevice",
    "SimulatedDeviceProperties",
    "cuda_replacements",
    "record_stream",
]


class NotSimulatedError(RuntimeError):
    """A CUDA API the simulated device does not model, named with what to do instead."""


class SimulatedDevice(Protocol):
    """What the virtual device reads its memory figures from (the sim backend)."""

    def allocated(self) -> int: ...

    def stats_peak_allocated(self) -> int: ...

    def reserved(self) -> int | None: ...

    def stats_peak_reserved(self) -> int: ...

    def reset_stats_peak(self) -> None: ...

    def reset_stats_counters(self) -> None: ...

    def release_cache(self) -> None: ...

    def empty_cache(self) -> None: ...

    def device_total(self) -> int: ...

    def memory_stats_nested(self) -> dict[str, Any]: ...

    def memory_summary(self) -> str: ...

    def counted(self, tensor: torch.Tensor) -> bool: ...

    #: Whether the running test's code sees a CUDA device (``torch.cuda.is_available()``);
    #: where not, the device queries answer as the machine does, and memory is still counted.
    cuda_shown: bool


@dataclass(frozen=True)
class SimulatedDeviceProperties:
    """What ``torch.cuda.get_device_properties`` returns for the simulated device."""

    name: str
    total_memory: int
    major: int = 9
    minor: int = 0
    multi_processor_count: int = 132
    is_integrated: bool = False
    is_multi_gpu_board: bool = False
    max_threads_per_multi_processor: int = 2048
    warp_size: int = 32
    L2_cache_size: int = 50 * 1024 * 1024
    gcnArchName: str = "NVIDIA"
    uuid: str = "00000000-0000-0000-0000-000000000000"


DEVICE_NAME = "pytest-vram simulated CUDA device"


class _Stream:
    """A CUDA stream on a device that computes nothing: every wait is already over."""

    device = torch.device("cuda", 0)
    device_index = 0
    device_type = 1
    stream_id = 0
    cuda_stream = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> _Event:
        return event if event is not None else _Event()

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0


class _Event:
    """A CUDA event on a device that computes nothing: no time passes between two of them."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class _DeviceGuard:
    """``torch.cuda.device(i)``: there is one simulated device, so selecting it changes nothing."""

    def __init__(self, device: Any = None) -> None:
        self.idx = 0

    def __enter__(self) -> _DeviceGuard:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def __call__(self, func: Callable) -> Callable:
        return func


_STREAM = _Stream()


def record_stream(self: torch.Tensor, stream: Any) -> None:
    """``Tensor.record_stream``: every stream of the simulated device is done already, so the
    tensor's memory is never held for one."""
    __tracebackhide__ = True
    if not isinstance(stream, (_Stream, torch.Stream)):
        raise TypeError(
            f"record_stream(): argument 'stream' must be torch.Stream, not {type(stream).__name__}"
        )


class _NoListener:
    """Hears of allocations, and does nothing with them."""

    def allocated(self, tag: int, size: int, handle: Any) -> None:
        pass

    def resized(self, tag: int | None, old: int, new: int, handle: Any) -> None:
        pass

    def freed(self, tag: int | None, size: int, handle: Any) -> None:
        pass


_NO_LISTENER = _NoListener()


def _not_simulated(api: str, instead: str) -> Callable[..., Any]:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        __tracebackhide__ = True
        raise NotSimulatedError(f"{api} is not simulated on the simulated device: {instead}")

    return refuse


def _not_simulated_class(name: str, api: str, instead: str) -> type:
    """A class in place of ``api`` that cannot be made: still a class, so that annotations
    (``torch.cuda.CUDAGraph | None``) and ``isinstance`` in the libraries a test imports work."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        __tracebackhide__ = True
        raise NotSimulatedError(f"{api} is not simulated on the simulated device: {instead}")

    return type(name, (), {"__init__": __init__, "__doc__": f"{api}, not simulated."})


# CUDA graphs replay kernels without running Python: the simulated device, which computes
# nothing on a device, has nothing to capture.
_GRAPHS = "measure the step without CUDA graphs, or run this test with --vram-backend=cuda"


# The simulated device's tensors are CPU tensors, drawn from the CPU generator: CUDA's random
# state is that generator's, so fork_rng, torch.compile and checkpointing, which save and
# restore both, restore the one that was used.
def _get_rng_state(device: Any = "cuda") -> torch.Tensor:
    return torch.default_generator.get_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
    torch.default_generator.set_state(new_state)


def _manual_seed(seed: int) -> None:
    # Not torch.manual_seed, which seeds the CUDA generators in turn, that is: this.
    torch.default_generator.manual_seed(int(seed))


_RNG_FUNCTIONS: dict[str, Callable] = {
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
    "get_rng_state_all": lambda: [_get_rng_state()],
    "set_rng_state_all": lambda new_states: _set_rng_state(next(iter(new_states))),
    "manual_seed": _manual_seed,
    "manual_seed_all": _manual_seed,
    "seed": lambda: torch.default_generator.seed(),
    "seed_all": lambda: torch.default_generator.seed(),
    "initial_seed": lambda: torch.default_generator.initial_seed(),
}


def cuda_replacements(dev: SimulatedDevice) -> Iterator[tuple[object, str, object]]:
    """What to set, as ``(owner, name, value)``, in ``torch.cuda``, its ``memory`` and
    ``random`` modules and ``torch.accelerator``, for the simulated device ``dev``."""
    cuda = torch.cuda
    memory = torch.cuda.memory
    # The machine's own answers, for a test that is not shown the device (taken while nothing
    # is installed: the replacements are made once, before the first test).
    machine_available, machine_count = cuda.is_available, cuda.device_count
    accelerator = getattr(torch, "accelerator", None)
    machine_accelerator = getattr(accelerator, "current_accelerator", None)

    def is_available() -> bool:
        return True if dev.cuda_shown else machine_available()

    def device_count() -> int:
        return 1 if dev.cuda_shown else machine_count()

    def current_accelerator(check_available: bool = False) -> torch.device | None:
        if dev.cuda_shown or machine_accelerator is None:
            return torch.device("cuda")
        return machine_accelerator(check_available)

    # The GPU model simulated decides the capability code checks (9.0 by default).
    capability = getattr(dev, "gpu", None)
    major, minor = (9, 0) if capability is None else (capability.major, capability.minor)

    def properties(device: Any = None) -> SimulatedDeviceProperties:
        return SimulatedDeviceProperties(
            name=DEVICE_NAME, total_memory=dev.device_total(), major=major, minor=minor
        )

    def mem_get_info(device: Any = None) -> tuple[int, int]:
        total = dev.device_total()
        return max(total - (dev.reserved() or 0), 0), total

    def memory_stats(device: Any = None) -> OrderedDict[str, Any]:
        flat: list[tuple[str, Any]] = []

        def walk(prefix: str, value: Any) -> None:
            if isinstance(value, dict):
                for key, item in value.items():
                    walk(f"{prefix}.{key}" if prefix else key, item)
            else:
                flat.append((prefix, value))

        walk("", dev.memory_stats_nested())
        return OrderedDict(sorted(flat))

    def reset_peak(device: Any = None) -> None:
        # The test's own reset: what torch.cuda reads starts again, the plugin's figures not.
        dev.reset_stats_peak()

    def empty_cache() -> None:
        # CUDA's emptyCache returns cached blocks only: the cuBLAS workspaces are blocks in
        # use, and stay.
        dev.empty_cache()

    def own_allocator() -> Any:
        """The running test's own segments, where its memory is laid out and refused."""
        own = getattr(getattr(dev, "own_segments", None), "model", None)
        return own if own is not None else getattr(dev, "segments", None)

    def set_memory_fraction(fraction: float, device: Any = None) -> None:
        # As on a GPU: the allocator refuses to reserve more than the fraction of the device,
        # here for the rest of the test (the next test starts with segments of its own).
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        allocator = own_allocator()
        if allocator is None:
            raise NotSimulatedError(
                "torch.cuda.set_per_process_memory_fraction is not simulated on a device "
                "without an allocator model: use --vram-sim-capacity"
            )
        tracker = getattr(dev, "tracker", None)
        if tracker is not None:
            # A computing test may count in PyTorch's CPU allocator, which knows no capacity:
            # a listener moves the rest of the test to the tracker, whose segments refuse.
            tracker.add_listener(_NO_LISTENER)
            tracker.remove_listener(_NO_LISTENER)
        allocator.capacity = int(dev.device_total() * fraction)

    def get_memory_fraction(device: Any = None) -> float:
        capacity = getattr(own_allocator(), "capacity", None)
        return 1.0 if capacity is None else capacity / dev.device_total()

    functions: dict[str, Callable] = {
        "is_available": is_available,
        "device_count": device_count,
        "current_device": lambda: 0,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "init": lambda: None,
        "is_bf16_supported": lambda including_emulation=True: True,
        "get_device_name": lambda device=None: DEVICE_NAME,
        "get_device_capability": lambda device=None: (major, minor),
        "get_device_properties": properties,
        "mem_get_info": mem_get_info,
        "memory_allocated": lambda device=None: dev.allocated(),
        "max_memory_allocated": lambda device=None: dev.stats_peak_allocated(),
        "memory_reserved": lambda device=None: dev.reserved() or 0,
        "max_memory_reserved": lambda device=None: dev.stats_peak_reserved(),
        "memory_cached": lambda device=None: dev.reserved() or 0,
        "max_memory_cached": lambda device=None: dev.stats_peak_reserved(),
        "reset_peak_memory_stats": reset_peak,
        "reset_max_memory_allocated": reset_peak,
        "reset_max_memory_cached": reset_peak,
        "reset_accumulated_memory_stats": lambda device=None: dev.reset_stats_counters(),
        "memory_stats": memory_stats,
        "memory_stats_as_nested_dict": lambda device=None: dev.memory_stats_nested(),
        "memory_summary": lambda device=None, abbreviated=False: dev.memory_summary(),
        "empty_cache": empty_cache,
        "current_stream": lambda device=None: _STREAM,
        "default_stream": lambda device=None: _STREAM,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        "set_stream": lambda stream: None,
        "is_current_stream_capturing": lambda: False,
        "Stream": _Stream,
        "Event": _Event,
        "device": _DeviceGuard,
        "set_per_process_memory_fraction": set_memory_fraction,
        "get_per_process_memory_fraction": get_memory_fraction,
        "CUDAGraph": _not_simulated_class("CUDAGraph", "torch.cuda.CUDAGraph", _GRAPHS),
        "graph": _not_simulated_class("graph", "torch.cuda.graph", _GRAPHS),
        "make_graphed_callables": _not_simulated("torch.cuda.make_graphed_callables", _GRAPHS),
        "graph_pool_handle": _not_simulated("torch.cuda.graph_pool_handle", _GRAPHS),
        **_RNG_FUNCTIONS,
    }
    random = torch.cuda.random
    graphs = getattr(torch.cuda, "graphs", None)
    for name, value in functions.items():
        yield cuda, name, value
        for module in (memory, random, graphs):
            if module is not None and name in module.__dict__:
                yield module, name, value

    if accelerator is not None:
        yield accelerator, "is_available", is_available
        yield accelerator, "device_count", device_count
        yield accelerator, "current_device_index", lambda: 0
        yield accelerator, "set_device_index", lambda device: None
        yield accelerator, "synchronize", lambda device=None: None
        yield accelerator, "current_stream", lambda device=None: _STREAM
        yield accelerator, "current_accelerator", current_accelerator
        accelerator_memory = {
            "empty_cache": empty_cache,
            "memory_allocated": functions["memory_allocated"],
            "max_memory_allocated": functions["max_memory_allocated"],
            "memory_reserved": functions["memory_reserved"],
            "max_memory_reserved": functions["max_memory_reserved"],
            "reset_peak_memory_stats": reset_peak,
            "reset_accumulated_memory_stats": functions["reset_accumulated_memory_stats"],
            "memory_stats": memory_stats,
            "get_memory_info": mem_get_info,
        }
        for owner in (accelerator, getattr(accelerator, "memory", None)):
            if owner is not None:
                for name, value in accelerator_memory.items():
                    if name in owner.__dict__:
                        yield owner, name, value
