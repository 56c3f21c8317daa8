"""Real CUDA allocator traces: the pickles ``torch.cuda.memory._dump_snapshot()`` writes, read
as plain data, and the device as it was when their history recording started.

A snapshot holds only dicts, lists, strings and numbers; a pickle that names any class or
function is refused before anything of it runs. The checks of the segment model against real
GPUs replay a trace's requests from the state :func:`restore_before_recording` lays out.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from pytest_vram.backends.segments import CachingAllocatorModel

__all__ = ["GlobalsRefused", "load_snapshot", "restore_before_recording", "trace_of"]


class GlobalsRefused(pickle.UnpicklingError):
    """A snapshot pickle named a class or function: it is not a snapshot."""


class _DataOnly(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise GlobalsRefused(f"refused {module}.{name}: a snapshot holds plain data only")


def load_snapshot(path: Path) -> dict[str, Any]:
    """The snapshot pickled at ``path``, refusing every global."""
    with path.open("rb") as file:
        return _DataOnly(file).load()


def trace_of(snapshot: dict[str, Any]) -> list[dict[str, Any]]:
    """The one device trace a single-GPU snapshot records."""
    (trace,) = [events for events in snapshot["device_traces"] if events]
    return trace


def restore_before_recording(
    snapshot: dict[str, Any], model: CachingAllocatorModel
) -> CachingAllocatorModel:
    """``model`` holding what was on the device before recording started: the blocks in use at
    the end that no traced request made, in the segments the trace did not ask for, the rest
    of those segments cached; its peaks start there."""
    trace = trace_of(snapshot)
    traced_blocks = {e["addr"] for e in trace if e["action"] == "alloc"}
    traced_segments = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    for segment in snapshot["segments"]:
        if segment["address"] in traced_segments:
            continue
        model.restore_segment(
            segment["address"],
            segment["total_size"],
            [
                (block["address"], block["size"])
                for block in segment["blocks"]
                if block["state"] == "active_allocated" and block["address"] not in traced_blocks
            ],
            small=segment["segment_type"] == "small",
        )
    model.reset_peak()
    return model
