"""The simulated device's allocator counts what a GPU's does: cuBLAS workspaces, and the blocks
it hands out rather than the requests."""

from __future__ import annotations

import json
import pickle
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pytest_vram.backends.segments import CachingAllocatorModel, OwnSegments
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.sim.workspaces import (
    DEFAULT_GPU,
    GPU_MODELS,
    gpu_model,
    workspace_size,
)

KiB, MiB = 1 << 10, 1 << 20
HOPPER_WORKSPACE = 32 * MiB
AMPERE_WORKSPACE = 8 * MiB + 128 * KiB


@pytest.fixture
def sim(monkeypatch: pytest.MonkeyPatch) -> Iterator[SimBackend]:
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    backend = SimBackend(workspaces=True)
    backend.release_cache()
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.end_test()


# -- workspace sizes, as CublasHandlePool.cpp chooses them -------------------------------------


@pytest.mark.parametrize(
    ("major", "config", "size"),
    [
        (9, None, HOPPER_WORKSPACE),
        (10, None, HOPPER_WORKSPACE),
        (8, None, AMPERE_WORKSPACE),
        (7, None, AMPERE_WORKSPACE),
        (9, ":4096:8", HOPPER_WORKSPACE),
        (9, ":16:8", 128 * KiB),  # the deterministic-algorithms setting
        (8, ":4096:2:16:8", AMPERE_WORKSPACE),
        (9, ":0:0", 0),
        (9, "nonsense", HOPPER_WORKSPACE),  # PyTorch warns and keeps its default
    ],
)
def test_workspace_size(major: int, config: str | None, size: int) -> None:
    assert workspace_size(major, config) == size


def test_gpu_models_are_found_by_the_name_cuda_gives_them() -> None:
    h100 = gpu_model("  nvidia h100 80gb   HBM3 ")
    assert h100.name == DEFAULT_GPU
    assert (h100.major, h100.minor) == (9, 0)
    assert 79 << 30 < h100.total_memory < 80 << 30
    with pytest.raises(ValueError, match="'RTX 9999' is not a known GPU model: expected one of"):
        gpu_model("RTX 9999")


# -- workspaces on the simulated device -------------------------------------------------------


def test_the_first_matmul_allocates_a_workspace_and_later_ones_reuse_it(sim: SimBackend) -> None:
    a = torch.randn(64, 64, device="cuda")
    before = sim.allocated()
    b = a @ a
    assert sim.allocated() == before + b.untyped_storage().nbytes() + HOPPER_WORKSPACE
    c = a @ b
    assert sim.allocated() == before + 2 * b.untyped_storage().nbytes() + HOPPER_WORKSPACE
    del c
    assert torch.cuda.memory_allocated() == sim.allocated()


def test_no_matmul_no_workspace(sim: SimBackend) -> None:
    a = torch.randn(1024, device="cuda")
    (a * 2).sum()
    assert sim.allocated() < MiB


def test_backward_holds_a_second_workspace(sim: SimBackend) -> None:
    weight = torch.randn(64, 64, device="cuda", requires_grad=True)
    x = torch.randn(8, 64, device="cuda")
    (x @ weight).sum().backward()
    assert len(sim.workspaces.held()) == 2
    assert sim.peak_allocated() > 2 * HOPPER_WORKSPACE


def test_each_thread_that_multiplies_has_its_own_workspace(sim: SimBackend) -> None:
    a = torch.randn(16, 16, device="cuda")
    a @ a
    # The simulated device counts the test's own thread; another thread's matmul asks the
    # pool from there.
    thread = threading.Thread(target=sim.workspaces.on_matmul)
    thread.start()
    thread.join()
    assert len(sim.workspaces.held()) == 2


def test_every_test_allocates_its_own_as_on_cuda(sim: SimBackend) -> None:
    a = torch.randn(64, 64, device="cuda")
    a @ a
    sim.end_test()
    held = sim.allocated()
    # The per-test clean-up clears the workspaces, as torch._C._cuda_clearCublasWorkspaces().
    sim.release_cache()
    assert sim.allocated() == held - HOPPER_WORKSPACE
    sim.begin_test()
    a @ a
    assert len(sim.workspaces.held()) == 1


def test_the_workspace_config_and_the_gpu_model_set_the_size(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert SimBackend(workspaces=True).workspaces.size == 128 * KiB
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG")
    a100 = SimBackend(gpu="NVIDIA A100-SXM4-80GB", workspaces=True)
    assert a100.workspaces.size == AMPERE_WORKSPACE
    # A model named without a capacity brings its memory; the default model brings none.
    assert a100.capacity == GPU_MODELS["NVIDIA A100-SXM4-80GB"].total_memory
    assert SimBackend(workspaces=True).capacity is None
    assert SimBackend().workspaces.size == 0
    assert SimBackend(capacity="1GB", gpu="NVIDIA H200").capacity == 10**9


def test_the_gpu_model_answers_capability_queries() -> None:
    backend = SimBackend(gpu="NVIDIA A100-SXM4-40GB")
    backend.begin_test()
    try:
        assert torch.cuda.get_device_capability() == (8, 0)
        assert torch.cuda.get_device_properties(0).major == 8
    finally:
        backend.end_test()


# -- allocated is the block handed out --------------------------------------------------------


def test_allocated_counts_the_remainder_a_large_block_keeps() -> None:
    device = CachingAllocatorModel()
    own = OwnSegments(device)
    first = own.malloc(12 * MiB)
    own.free(first)
    # 11.5 MiB in the cached 12 MiB block leaves 0.5 MiB, too little to split off (1 MiB).
    block = own.malloc(11 * MiB + 512 * KiB)
    assert own.handed_out(block, 11 * MiB + 512 * KiB) == 12 * MiB
    assert device.allocated == 12 * MiB


def test_the_sims_allocated_is_what_cuda_counts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
    backend = SimBackend()
    backend.begin_test()
    try:
        scratch = torch.empty(12 * MiB, dtype=torch.uint8, device="cuda")
        del scratch
        kept = torch.empty(11 * MiB + 512 * KiB, dtype=torch.uint8, device="cuda")
        assert torch.cuda.memory_allocated() == backend.allocated() == 12 * MiB
        assert backend.storage_bytes(kept) == 11 * MiB + 512 * KiB
    finally:
        backend.end_test()


# -- end to end: breakdowns and snapshots name the workspaces ---------------------------------

MATMUL_TEST = """
import torch

def test_matmul(vram):
    weight = torch.randn(256, 256, device="cuda", requires_grad=True)
    x = torch.randn(32, 256, device="cuda")
    (x @ weight).sum().backward()
    assert False, "to get a snapshot"
"""


def test_breakdown_and_snapshot_name_the_workspaces(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mm=MATMUL_TEST)
    result = pytester.runpytest(
        "--vram-backend=sim",
        "--vram-breakdown",
        "--vram-snapshot-on-fail=snaps",
        "--vram-json=out.json",
        "--vram-sim-gpu=NVIDIA H200",
    )
    result.assert_outcomes(failed=1)
    (test,) = json.loads((pytester.path / "out.json").read_text())["tests"]
    breakdown = test["breakdown"]
    # Their own category, not other: a budget they break names them.
    assert breakdown["categories"]["cublas_workspaces"] == 2 * HOPPER_WORKSPACE
    assert breakdown["categories"]["other"] == 0
    modules = {module["name"]: module for module in breakdown["modules"]}
    assert modules["cuBLAS workspace"]["categories"] == {"cublas_workspaces": 2 * HOPPER_WORKSPACE}
    (path,) = (pytester.path / "snaps").iterdir()
    snapshot = pickle.loads(path.read_bytes())
    workspaces = [
        e
        for e in snapshot["device_traces"][0]
        if e["action"] == "alloc" and any(f["name"] == "cublas_workspace" for f in e["frames"])
    ]
    assert [e["size"] for e in workspaces] == [HOPPER_WORKSPACE] * 2
    frame = next(f for f in workspaces[0]["frames"] if f["name"] == "cublas_workspace")
    assert Path(frame["filename"]).name == "workspaces.py"


def test_a_budget_the_workspaces_break_names_them(pytester: pytest.Pytester) -> None:
    # The tensors take 320 KiB; the two workspaces 64 MiB.
    pytester.makepyfile(
        test_mm=MATMUL_TEST.replace("def test_matmul", "@max_vram('16MiB')\ndef test_matmul")
        .replace("import torch", "import torch\nfrom pytest_vram import max_vram")
        .replace('    assert False, "to get a snapshot"\n', "")
    )
    result = pytester.runpytest("--vram-backend=sim", "--vram-update-baselines")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["*exceeds max_vram(16.00 MiB)*", "at the peak: cuBLAS workspaces 64.00 MiB, *"]
    )


def test_an_unknown_gpu_model_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mm=MATMUL_TEST)
    result = pytester.runpytest("--vram-backend=sim", "--vram-sim-gpu=RTX 9999")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*--vram-sim-gpu / vram_sim_gpu: 'RTX 9999' is not a known GPU model: expected one of*"]
    )
    assert "Traceback" not in result.stderr.str()


TRAINING_STEP = """
import torch

def test_step(vram):
    model = torch.nn.Linear(256, 256, device=vram.device)
    model(torch.ones(8, 256, device=vram.device)).sum().backward()
"""


def test_workspaces_that_outlive_a_test_are_not_its_leftover(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_step=TRAINING_STEP)
    result = pytester.runpytest("--vram-backend=sim", "--vram-json=out.json")
    result.assert_outcomes(passed=1)
    (test,) = json.loads((pytester.path / "out.json").read_text())["tests"]
    # The peak holds the forward's and autograd's workspaces; what the test left holds none.
    assert test["peak_allocated"] >= 2 * 32 * 2**20
    assert test["leftover"] == 0


def test_empty_cache_keeps_the_workspaces_as_cuda_does(sim: SimBackend) -> None:
    # CUDA's emptyCache returns cached blocks only; a workspace is a block in use, and the
    # next matrix product on the thread makes none.
    a = torch.randn(64, 64, device="cuda")
    a @ a
    held = sim.allocated()
    torch.cuda.empty_cache()
    assert sim.allocated() == held
    assert len(sim.workspaces.held()) == 1
    a @ a
    assert len(sim.workspaces.held()) == 1
