"""The segment model replays real CUDA allocator traces exactly.

Each trace in ``tests/data/traces`` (see its README for where it came from) is a memory
snapshot a real GPU wrote: the segments and blocks at the end, and every allocator event since
recording started. The model is given the segments that existed before (the model's weights),
then every request of the trace in order, and must put every block where the real allocator
put it, ask for every segment the real allocator asked for, and end with the real allocated
and reserved bytes.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.backends.segments import Block, CachingAllocatorModel
from pytest_vram.backends.traces import (
    GlobalsRefused,
    blocks_before_recording,
    load_snapshot,
    trace_of,
)

TRACES = sorted((Path(__file__).parent / "data" / "traces").glob("*.pickle"))


class Replay(CachingAllocatorModel):
    """The model, with each new segment at the address the driver gave the real one."""

    def __init__(self) -> None:
        super().__init__()
        self.driver: list[tuple[int, int]] = []  # the trace's segment_alloc events, pending
        self.segment_mismatches: list[tuple[int, int]] = []

    def segment_address(self, size: int) -> int:
        address, real_size = self.driver.pop(0)
        if real_size != size:
            self.segment_mismatches.append((size, real_size))
        return address


def replay(snapshot: dict[str, Any]) -> tuple[Replay, dict[str, Any]]:
    trace = trace_of(snapshot)
    # What was there before recording started: the blocks in use at the end that no traced
    # request made and those the trace frees first (an earlier step's), the rest of their
    # segments cached.
    model = Replay()
    live: dict[int, Block] = blocks_before_recording(snapshot, model)
    misplaced = []
    requested = peak_requested = 0
    for event in trace:
        action = event["action"]
        if action == "segment_alloc":
            model.driver.append((event["addr"], event["size"]))
        elif action == "alloc":
            block = model.malloc(event["size"])
            assert block is not None
            if block.addr != event["addr"]:
                misplaced.append((event["addr"], block.addr, event["size"]))
            live[event["addr"]] = block
            requested += event["size"]
            peak_requested = max(peak_requested, requested)
        elif action == "free_completed":
            model.free(live.pop(event["addr"]))
            requested -= event["size"]
    return model, {
        "requests": sum(1 for e in trace if e["action"] == "alloc"),
        "misplaced": misplaced,
        "live": live,
        "segments_left": model.driver,
        "peak_requested": peak_requested,
    }


@pytest.fixture(params=TRACES, ids=[path.stem for path in TRACES])
def snapshot(request: pytest.FixtureRequest) -> dict[str, Any]:
    return load_snapshot(request.param)


def test_traces_are_committed() -> None:
    assert len(TRACES) >= 3


def test_every_block_lands_where_the_real_allocator_put_it(snapshot: dict[str, Any]) -> None:
    model, result = replay(snapshot)
    assert result["requests"] > 1000
    # Same address means the same offset in the same segment: the model chose the same cached
    # block, split it the same way, and asked the driver for the same segments.
    assert result["misplaced"] == []
    assert model.segment_mismatches == []
    assert result["segments_left"] == []


def test_segments_and_reserved_bytes_match(snapshot: dict[str, Any]) -> None:
    model, _ = replay(snapshot)
    real = {segment["address"]: segment["total_size"] for segment in snapshot["segments"]}
    assert model.segment_sizes == real
    assert model.reserved == sum(real.values())
    # No segment was freed while recording: the peak is the end.
    assert not any(e["action"] == "segment_free" for e in snapshot["device_traces"][0])
    assert model.peak_reserved == model.reserved


def test_allocated_counts_handed_out_blocks_as_cuda_does(snapshot: dict[str, Any]) -> None:
    model, result = replay(snapshot)
    real_blocks = {
        block["address"]: block["size"]
        for segment in snapshot["segments"]
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }
    # Each block still live at the end has the size the real allocator gave it, a remainder
    # it did not split off included...
    assert {addr: block.size for addr, block in result["live"].items()} == {
        addr: real_blocks[addr] for addr in result["live"]
    }
    # ...so allocated is what the real allocated_bytes stat reads, more than the requests.
    assert model.allocated == sum(segment["allocated_size"] for segment in snapshot["segments"])
    requested = sum(
        block["requested_size"]
        for segment in snapshot["segments"]
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    )
    assert model.allocated > requested
    assert model.peak_allocated >= model.allocated


def test_a_pickle_that_names_a_class_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [Path("x")]}))
    with pytest.raises(GlobalsRefused, match="pathlib"):
        load_snapshot(path)
