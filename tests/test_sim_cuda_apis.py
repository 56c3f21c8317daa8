"""CUDA APIs beyond the memory queries on the simulated device: streams a tensor is recorded
on, the per-process memory fraction, CUDA graphs (refused, by name) and PyTorch's memory
history and snapshots."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.cuda._memory_viz as memory_viz
from simulated_device import simulated

from pytest_vram.backends.sim.torchcuda import NotSimulatedError

MIB = 1 << 20


@pytest.mark.parametrize("computing", [False, True], ids=["shape-only", "computing"])
def test_a_tensor_is_recorded_on_a_stream_as_on_a_gpu(computing: bool) -> None:
    with simulated(computing):
        x = torch.ones(1024, device="cuda")
        x.record_stream(torch.cuda.current_stream())
        x.record_stream(torch.cuda.Stream())
        with pytest.raises(TypeError, match=r"argument 'stream' must be torch\.Stream, not int"):
            x.record_stream(3)
    assert "record_stream" not in torch.Tensor.__dict__  # put back: inherited again


@pytest.mark.parametrize("computing", [False, True], ids=["shape-only", "computing"])
def test_the_memory_fraction_caps_the_allocator_for_the_rest_of_the_test(
    computing: bool,
) -> None:
    with simulated(computing, capacity="1GiB") as backend:
        assert torch.cuda.get_per_process_memory_fraction() == 1.0
        torch.cuda.set_per_process_memory_fraction(0.25)
        assert torch.cuda.get_per_process_memory_fraction() == 0.25
        kept = torch.empty(200 * MIB, dtype=torch.uint8, device="cuda")
        with pytest.raises(torch.cuda.OutOfMemoryError):
            torch.empty(100 * MIB, dtype=torch.uint8, device="cuda")
        del kept
    # The next test has the whole device again.
    backend.begin_test()
    try:
        assert torch.cuda.get_per_process_memory_fraction() == 1.0
        torch.empty(500 * MIB, dtype=torch.uint8, device="cuda")
    finally:
        backend.end_test()


@pytest.mark.parametrize(
    ("fraction", "error", "message"),
    [
        (1, TypeError, "Invalid type for fraction argument, must be `float`"),
        (1.5, ValueError, "Invalid fraction value: 1.5. Allowed range: 0~1"),
    ],
)
def test_a_memory_fraction_torch_refuses_is_refused_alike(
    fraction: object, error: type[Exception], message: str
) -> None:
    with simulated(), pytest.raises(error, match=message):
        torch.cuda.set_per_process_memory_fraction(fraction)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("api", "call"),
    [
        ("torch.cuda.CUDAGraph", lambda: torch.cuda.CUDAGraph()),
        ("torch.cuda.graph", lambda: torch.cuda.graph(None)),
        ("torch.cuda.make_graphed_callables", lambda: torch.cuda.make_graphed_callables(abs, ())),
    ],
)
def test_a_cuda_graph_is_refused_in_one_line_naming_the_api(api: str, call: object) -> None:
    with simulated(), pytest.raises(NotSimulatedError) as info:
        call()  # type: ignore[operator]
    assert str(info.value) == (
        f"{api} is not simulated on the simulated device: measure the step without CUDA "
        "graphs, or run this test with --vram-backend=cuda"
    )


def test_the_cuda_graph_classes_stay_classes_for_the_libraries_that_name_them() -> None:
    # transformers annotates with torch.cuda.CUDAGraph | None where its modules are imported.
    with simulated():
        assert str(torch.cuda.CUDAGraph | None).endswith("CUDAGraph | None")
        assert not isinstance(object(), (torch.cuda.CUDAGraph, torch.cuda.graph))


def _blocks(snapshot: dict) -> list[dict]:
    return [block for segment in snapshot["segments"] for block in segment["blocks"]]


def _lines_here(block: dict) -> list[int]:
    return [frame["line"] for frame in block["frames"] if frame["filename"] == __file__]


@pytest.mark.parametrize("computing", [False, True], ids=["shape-only", "computing"])
def test_the_memory_history_recipe_gives_a_snapshot_memory_viz_reads(
    computing: bool, tmp_path: Path
) -> None:
    with simulated(computing) as backend:
        early = torch.ones(4096, device="cuda")  # before the recording: no stack
        torch.cuda.memory._record_memory_history(max_entries=1000)
        kept = torch.ones(1024, device="cuda")
        kept_line = _line() - 1
        assert kept.numel() == 1024
        gone = torch.ones(MIB, device="cuda")
        del gone
        torch.cuda.memory._dump_snapshot(str(tmp_path / "snapshot.pickle"))
        torch.cuda.memory._record_memory_history(enabled=None)
        assert not backend.tracker.listeners
    snapshot = pickle.loads((tmp_path / "snapshot.pickle").read_bytes())
    states = {
        (block["size"], block["state"], tuple(_lines_here(block))) for block in _blocks(snapshot)
    }
    assert (4096, "active_allocated", (kept_line,)) in states
    if not computing:  # computing, what came before counted in PyTorch's CPU allocator
        assert (16384, "active_allocated", ()) in states  # in use, allocated before
    actions = [(entry["action"], entry["size"]) for entry in snapshot["device_traces"][0]]
    assert ("alloc", 4096) in actions
    assert ("free_completed", 4 * MIB) in actions
    assert early.numel() == 4096
    # What python -m torch.cuda._memory_viz draws.
    assert "<html" in memory_viz.trace_plot(snapshot).lower()
    assert "<html" in memory_viz.segment_plot(snapshot).lower()
    assert "total_allocated" in memory_viz.segsum(snapshot)


def test_a_snapshot_without_a_recording_lists_the_blocks_without_stacks() -> None:
    with simulated():
        x = torch.ones(1024, device="cuda")
        snapshot = torch.cuda.memory._snapshot()
        segments = torch.cuda.memory_snapshot()
    assert snapshot["device_traces"] == [[]]
    assert [block["frames"] for block in _blocks(snapshot)] == [[], []]
    assert {(block["size"], block["state"]) for block in _blocks(snapshot)} >= {
        (4096, "active_allocated")
    }
    assert segments == snapshot["segments"] and x.numel() == 1024


def test_a_recording_ends_with_its_test() -> None:
    with simulated() as backend:
        torch.cuda.memory._record_memory_history()
        assert backend.tracker.listeners
    assert not backend.tracker.listeners and backend.segments.segment_listener is None
    backend.begin_test()
    try:
        torch.ones(1024, device="cuda")
        assert torch.cuda.memory._snapshot()["device_traces"] == [[]]
    finally:
        backend.end_test()


def _line() -> int:
    import sys

    return sys._getframe(1).f_lineno


API_TESTS = """
import pickle

import pytest
import torch


def test_apis(vram, tmp_path):
    x = torch.ones(1024, device="cuda")
    x.record_stream(torch.cuda.current_stream())
    torch.cuda.set_per_process_memory_fraction(0.01)
    torch.cuda.memory._record_memory_history()
    y = torch.ones(2048, device="cuda")
    torch.cuda.memory._dump_snapshot(str(tmp_path / "s.pickle"))
    blocks = [b for s in pickle.loads((tmp_path / "s.pickle").read_bytes())["segments"]
              for b in s["blocks"]]
    assert any(f["name"] == "test_apis" for b in blocks for f in b["frames"])


def test_graph(vram):
    torch.cuda.CUDAGraph()
"""


def test_the_apis_under_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_apis=API_TESTS)
    result = pytester.runpytest("--vram-backend=sim", "-p", "no:randomly")
    result.assert_outcomes(passed=1, failed=1)
    assert "def refuse" not in result.stdout.str()  # the user's line, not the plugin's
    result.stdout.fnmatch_lines(
        [
            "E *NotSimulatedError: torch.cuda.CUDAGraph is not simulated on the simulated "
            "device: measure the step without CUDA graphs, or run this test with "
            "--vram-backend=cuda"
        ]
    )
