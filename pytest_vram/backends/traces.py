"""Real CUDA allocator traces: the pickles ``torch.cuda.memory._dump_snapshot()`` writes, read
as plain data, and the device as it was when their history recording started.

A snapshot holds only dicts, lists, strings and numbers; a pickle that names any class or
function is refused before anything of it runs. The checks of the segment model against real
GPUs replay a trace's requests from the state :func:`blocks_before_recording` lays out.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

from pytest_vram.backends.segments import Block, CachingAllocatorModel, round_request

__all__ = [
    "GlobalsRefused",
    "blocks_before_recording",
    "load_snapshot",
    "trace_of",
]


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


def blocks_before_recording(
    snapshot: dict[str, Any], model: CachingAllocatorModel
) -> dict[int, Block]:
    """Lay out on ``model`` what was on the device before recording started, and return its
    blocks in use by address: the blocks in use at the end that no traced request made, and
    those the trace frees before it allocates at their address (a tensor of an earlier step,
    freed in the recorded one; its block is its rounded size), in the segments the trace did
    not ask for, the rest of those segments cached."""
    trace = trace_of(snapshot)
    traced_blocks: set[int] = set()
    freed_first: dict[int, int] = {}
    for event in trace:
        if event["action"] == "alloc":
            traced_blocks.add(event["addr"])
        elif event["action"] == "free_completed" and event["addr"] not in traced_blocks:
            freed_first.setdefault(event["addr"], round_request(event["size"]))
    traced_segments = {e["addr"] for e in trace if e["action"] == "segment_alloc"}
    blocks: dict[int, Block] = {}
    for segment in snapshot["segments"]:
        if segment["address"] in traced_segments:
            continue
        start, end = segment["address"], segment["address"] + segment["total_size"]
        in_use = [
            (block["address"], block["size"])
            for block in segment["blocks"]
            if block["state"] == "active_allocated" and block["address"] not in traced_blocks
        ]
        in_use += [(addr, size) for addr, size in freed_first.items() if start <= addr < end]
        for block in model.restore_segment(
            start, segment["total_size"], in_use, small=segment["segment_type"] == "small"
        ):
            blocks[block.addr] = block
    model.reset_peak()
    return blocks
