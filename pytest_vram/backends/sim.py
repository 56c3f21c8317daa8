"""The simulated device: CUDA memory of code that runs on fake tensors, in seconds, without a GPU.

A measured test runs under PyTorch's ``FakeTensorMode``: every tensor carries its shape, dtype
and storage size but no data, so nothing is computed and a 32B-parameter training step takes
seconds on a laptop. A :class:`~pytest_vram.backends.tracker.StorageTracker` counts the live
storages as the CUDA caching allocator would hand them out (multiples of 512 bytes), a
:class:`~pytest_vram.backends.segments.CachingAllocatorModel` replays the allocator's segments
for reserved memory and out-of-memory, and :class:`~pytest_vram.backends.fakecuda.VirtualCuda`
makes ``device="cuda"``, ``.cuda()``, ``torch.autocast("cuda")`` and ``torch.cuda.*`` queries
work on a CPU-only build of PyTorch. See ``docs/sim.md``.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)

from pytest_vram.backends.base import Backend
from pytest_vram.backends.fakecuda import VirtualCuda
from pytest_vram.backends.segments import CachingAllocatorModel
from pytest_vram.backends.tracker import StorageTracker, round_like_cuda_allocator
from pytest_vram.units import format_size, parse_size

__all__ = ["UNLIMITED_TOTAL", "SimBackend", "needs_values_error"]

#: What ``torch.cuda.get_device_properties().total_memory`` and ``mem_get_info`` report for a
#: simulated device without a capacity: 1 PiB, more than any model here can ask for.
UNLIMITED_TOTAL = 1 << 50

_NEEDS_VALUES = (DataDependentOutputException, DynamicOutputShapeException)
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_FRAMEWORK_MARKERS = (
    os.sep + "_pytest" + os.sep,
    os.sep + "pluggy" + os.sep,
    os.sep + "contextlib.py",
)


def _on_device(tensor: torch.Tensor) -> bool:
    # Every fake tensor of the simulation is device memory, host tensors included; meta
    # tensors are shapes only, and real tensors were made outside the simulation.
    return isinstance(tensor, FakeTensor) and tensor.fake_device.type != "meta"


def needs_values_error(exc: BaseException | None) -> BaseException | None:
    """The FakeTensorMode error in ``exc``'s chain that says an op needed tensor values."""
    pending = [exc]
    seen: set[int] = set()
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, _NEEDS_VALUES):
            return current
        pending.extend((current.__context__, current.__cause__))
    return None


def _user_location(exc: BaseException) -> str | None:
    """``file:line`` of the innermost frame of ``exc``'s traceback in the test's own code."""
    location = None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if not (
            filename.startswith((_TORCH_DIR, _PACKAGE_DIR))
            or any(marker in filename for marker in _FRAMEWORK_MARKERS)
        ):
            location = f"{filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    return location


class _SimFakeTensorMode(FakeTensorMode):
    """FakeTensorMode that counts the storages of what each op returns.

    Counting here, rather than in a second dispatch mode stacked on top, saves a trip through
    Python for every op; only the ops a program calls are counted, not those FakeTensorMode
    runs inside them (decompositions), just as a mode stacked above would see them.
    """

    # Like the storage tracker's mode, this one opts out of the wrapper torch puts around every
    # mode's dispatch to keep Dynamo out of it: the wrapper costs every op, and nothing here
    # is compiled.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __init__(self, tracker: StorageTracker) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self._observe_output = tracker.observe_output
        self._depth = 0

    def __deepcopy__(self, memo: dict[int, Any]) -> _SimFakeTensorMode:
        # copy.deepcopy(model) copies each fake tensor's __dict__, its mode included; there is
        # one simulated device, and the copies belong to it.
        return self

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[override]
        self._depth += 1
        try:
            out = self.dispatch(func, types, args, kwargs)
        finally:
            self._depth -= 1
        # Queries such as prim.device, a third of the ops, return no tensor: skip them cheaply.
        if self._depth == 0 and isinstance(out, (torch.Tensor, tuple, list)):
            self._observe_output(func, out)
        return out


class SimBackend(Backend):
    """A CUDA device simulated on fake tensors.

    One ``FakeTensorMode`` and one tracker serve the whole session, so that fixtures of module
    scope stay fake and counted across tests; the virtual CUDA device is installed only while a
    test runs. ``capacity`` (bytes or a size string) makes allocations that would not fit
    raise ``torch.cuda.OutOfMemoryError``; None means unlimited.
    """

    name = "sim"
    device = torch.device("cpu")

    def __init__(self, capacity: int | str | None = None) -> None:
        self.capacity = None if capacity is None else parse_size(capacity)
        self.segments = CachingAllocatorModel(capacity=self.capacity)
        self.tracker = StorageTracker(
            counts=_on_device,
            size_of=round_like_cuda_allocator,
            allocator=self.segments,
            count_unseen_aliases=False,
        )
        self.fake_mode = _SimFakeTensorMode(self.tracker)
        self.cuda = VirtualCuda(self)
        self._active = False
        self._counters_at_start = (0, 0)

    def total_memory(self) -> int | None:
        return self.capacity

    def device_total(self) -> int:
        """The device size ``torch.cuda`` reports: the capacity, or :data:`UNLIMITED_TOTAL`."""
        return self.capacity if self.capacity is not None else UNLIMITED_TOTAL

    def begin_test(self) -> None:
        if self._active:
            return
        self._counters_at_start = (self.segments.num_ooms, self.segments.num_alloc_retries)
        # The fake mode first: entering it reads torch.cuda.is_available(), which must be the
        # real answer.
        self.fake_mode.__enter__()
        try:
            self.cuda.install()
        except BaseException:
            self.fake_mode.__exit__(None, None, None)
            raise
        self._active = True

    def end_test(self) -> None:
        if not self._active:
            return
        self._active = False
        try:
            self.cuda.uninstall()
        finally:
            self.fake_mode.__exit__(None, None, None)

    @property
    def active(self) -> bool:
        """Whether a test is running on the simulated device now."""
        return self._active

    def allocated(self) -> int:
        return self.tracker.current

    def peak_allocated(self) -> int:
        return self.tracker.peak

    def reset_peak(self) -> None:
        self.tracker.reset_peak()
        self.segments.reset_peak()

    def storage_bytes(self, tensor: torch.Tensor) -> int | None:
        if not _on_device(tensor):
            return None
        return round_like_cuda_allocator(tensor.untyped_storage().nbytes())

    def reserved(self) -> int | None:
        self.tracker.flush()  # frees of storages that died reach the segments first
        return self.segments.reserved

    def peak_reserved(self) -> int | None:
        self.tracker.flush()
        return self.segments.peak_reserved

    def release_cache(self) -> None:
        self.tracker.flush()
        self.segments.empty_cache()

    def counters(self) -> dict[str, int]:
        self.tracker.flush()
        ooms, retries = self._counters_at_start
        return {
            "num_ooms": self.segments.num_ooms - ooms,
            "num_alloc_retries": self.segments.num_alloc_retries - retries,
            "inactive_split_bytes": self.segments.inactive_split_bytes(),
        }

    def memory_stats_nested(self) -> dict[str, Any]:
        """``torch.cuda.memory_stats_as_nested_dict()`` of the simulated device."""
        allocated, peak = self.allocated(), self.peak_allocated()
        seg = self.segments

        def stat(current: int, peak: int | None = None) -> dict[str, dict[str, int]]:
            return {"all": {"current": current, "peak": current if peak is None else peak}}

        return {
            "allocated_bytes": stat(allocated, peak),
            "active_bytes": stat(allocated, peak),
            "reserved_bytes": stat(seg.reserved, seg.peak_reserved),
            "inactive_split_bytes": stat(seg.inactive_split_bytes()),
            "segment": stat(seg.segments),
            "num_alloc_retries": seg.num_alloc_retries,
            "num_ooms": seg.num_ooms,
            "num_device_alloc": seg.num_device_alloc,
            "num_device_free": seg.num_device_free,
        }

    def memory_summary(self) -> str:
        seg = self.segments
        allocated, peak = self.allocated(), self.peak_allocated()
        capacity = "unlimited" if self.capacity is None else format_size(self.capacity)
        return "\n".join(
            [
                "pytest-vram simulated CUDA device (sim backend)",
                f"  allocated: {format_size(allocated)} (peak {format_size(peak)})",
                f"  reserved:  {format_size(seg.reserved)} (peak {format_size(seg.peak_reserved)})"
                f" in {seg.segments} segments",
                f"  cached, not allocated: {format_size(seg.reserved - seg.allocated)}"
                f" ({format_size(seg.inactive_split_bytes())} in partly used segments)",
                f"  capacity: {capacity}",
                f"  out-of-memory errors: {seg.num_ooms}, allocator retries: "
                f"{seg.num_alloc_retries}",
            ]
        )

    def explain_error(self, exc: BaseException) -> str | None:
        cause = needs_values_error(exc)
        if cause is None:
            return None
        func = getattr(cause, "func", None)
        if isinstance(cause, DynamicOutputShapeException):
            what = f"an op whose output shape depends on tensor values ({func})"
        else:
            what = (
                f"a tensor's value ({func}: .item(), .tolist(), bool(tensor) or a Python branch "
                "on a tensor)"
            )
        location = _user_location(exc) or _user_location(cause)
        where = f" at {location}" if location else ""
        return (
            f"the simulated device computes no values, and this test needs {what}{where}. "
            "On the sim backend tensors are fake: they carry shapes, dtypes and memory but no "
            "data. Run this test on a device that computes, with "
            '@pytest.mark.vram_backend("cpu") (or "cuda" on a GPU runner).'
        )

    def environment(self) -> dict[str, Any]:
        env = super().environment()
        env["sim_capacity"] = self.capacity
        return env

    def close(self) -> None:
        self.end_test()
