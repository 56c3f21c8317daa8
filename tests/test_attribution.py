"""Where the memory went: leak sites, the peak's breakdown, and snapshots from every backend."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from simulated_device import simulated

from pytest_vram.attribution.breakdown import PeakBreakdown, describe_growth, entry_categories
from pytest_vram.attribution.leaks import LeakSiteRecorder, survivors_in_snapshot
from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.measure.scenarios import LeakError, leak_check
from pytest_vram.record.figures import CATEGORY_FIGURES
from pytest_vram.record.record import TestRecord
from pytest_vram.wiring.snapshots import snapshot_name

SUITES = Path(__file__).resolve().parent.parent / "suites"
BACKENDS = [
    pytest.param(["--vram-backend=sim"], id="sim"),
    # Counted by the op counter, its categories from its log in C++.
    pytest.param(["--vram-backend=sim", "--vram-sim-compute=always"], id="sim-computing"),
    pytest.param(["--vram-backend=cpu", "--vram-cpu-counter=allocator"], id="cpu-allocator"),
    pytest.param(["--vram-backend=cpu", "--vram-cpu-counter=dispatch"], id="cpu-dispatch"),
]

LEAKY = """
import torch


class History:
    def __init__(self):
        self.kept = []

    def record(self, tensor):
        self.kept.append(tensor)


def step(history, x):
    y = x * 2                        # a temporary, freed every step
    history.record(torch.ones(256, device=x.device))   # the leak: 1 KiB a step
    return y.sum()


def test_leaks(vram):
    x = torch.ones(1024, device=vram.device)
    history = History()
    vram.leak_check(lambda: step(history, x), steps=20)
"""


@pytest.mark.parametrize("options", BACKENDS)
def test_a_failed_leak_check_names_the_line_that_allocated_the_leak(
    pytester: pytest.Pytester, options: list[str]
) -> None:
    pytester.makepyfile(test_leaky=LEAKY)
    result = pytester.runpytest(*options, "--vram-json=out.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "*still alive after the * confirmation steps, by allocation site:",
            "*test_leaky.py:14 in step: *KiB in * allocations (called from test_leaky.py:21 in "
            "<lambda>)",
        ]
    )
    # The temporary of line 13 is freed every step: it is no site of the leak.
    assert "test_leaky.py:13" not in result.stdout.str()
    (test,) = json.loads((pytester.path / "out.json").read_text())["tests"]
    (site,) = test["scenarios"]["leak_check"]["sites"]
    assert site["location"] == "test_leaky.py:14 in step"
    assert site["function"] == "step" and site["line"] == 14
    assert site["count"] >= 19 and site["bytes"] >= 19 * 1024


def test_a_leak_made_inside_a_library_names_the_users_line_that_called_it(
    pytester: pytest.Pytester,
) -> None:
    library = pytester.mkdir("site-packages")
    (library / "cachelib.py").write_text(
        "import torch\n_CACHE = []\n\ndef remember(x):\n    _CACHE.append(x * 1.0)\n    return x\n"
    )
    pytester.makepyfile(
        test_lib=f"""
import sys
sys.path.insert(0, {str(library)!r})
import torch
import cachelib

def test_leaks(vram):
    x = torch.ones(512, device=vram.device)
    vram.leak_check(lambda: cachelib.remember(x), steps=20)
"""
    )
    result = pytester.runpytest("--vram-backend=sim")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*test_lib.py:8 in <lambda>: *KiB in * allocations*"])
    assert "cachelib.py" not in result.stdout.str()


def test_sites_are_recorded_only_during_the_confirmation_steps() -> None:
    backend = SimBackend()
    backend.begin_test()
    kept: list[torch.Tensor] = []
    last: list[torch.Tensor] = []

    class Probe:
        def __init__(self) -> None:
            self.backend = backend

        def allocated(self) -> int:
            return backend.allocated()

        def reset_peak(self) -> None:
            backend.reset_peak()

        def peak(self) -> int:
            return backend.peak_allocated()

        def release_cache(self) -> None:
            backend.release_cache()

    def step() -> None:
        assert backend.tracker.listeners == () or confirming
        kept.append(torch.ones(128, device="cuda"))
        last[:] = [torch.ones(4096, device="cuda")]  # bounded: only the last step's is alive

    confirming = False
    original = LeakSiteRecorder.start

    def start(self: LeakSiteRecorder) -> None:
        nonlocal confirming
        confirming = True
        original(self)

    try:
        LeakSiteRecorder.start = start  # type: ignore[method-assign]
        with pytest.raises(LeakError) as failure:
            leak_check(Probe(), step, steps=20)
    finally:
        LeakSiteRecorder.start = original  # type: ignore[method-assign]
        backend.end_test()
    (site,) = failure.value.result.sites
    assert site.site[2] == "step"
    assert site.bytes == site.count * 512  # 128 floats rounded up to the allocator's 512 B
    assert backend.tracker.listeners == ()


def test_cuda_leak_sites_come_from_the_allocators_history_fake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[Any] = []
    user = {"filename": "/work/project/train.py", "line": 42, "name": "step"}
    torch_frame = {"filename": torch.__file__, "line": 1, "name": "ones"}

    def block(address: int, size: int, frames: list[dict[str, Any]] | None) -> dict[str, Any]:
        return {
            "address": address,
            "size": size,
            "requested_size": size,
            "state": "active_allocated",
            **({"frames": frames} if frames is not None else {}),
        }

    def snapshot() -> dict[str, Any]:
        return {
            "segments": [
                {
                    "device": 0,
                    "address": 0,
                    "total_size": 8192,
                    "blocks": [
                        block(0, 1024, [torch_frame, user]),  # allocated in step 1
                        block(1024, 1024, [torch_frame, user]),  # in step 2
                        block(2048, 2048, [user]),  # in the last step: what it returns
                        block(4096, 4096, None),  # from before the history
                    ],
                }
            ],
            "device_traces": [
                [
                    {"action": "alloc", "addr": 0, "size": 1024, "time_us": 10},
                    {"action": "alloc", "addr": 1024, "size": 1024, "time_us": 20},
                    {"action": "alloc", "addr": 2048, "size": 2048, "time_us": 10**18},
                ]
            ],
        }

    monkeypatch.setattr(
        torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append((a, k))
    )
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", snapshot)

    class FakeCuda:
        name = "cuda"
        device = torch.device("cuda", 0)
        memory_history = True

    recorder = LeakSiteRecorder(FakeCuda())
    with recorder:
        recorder.next_step()
        recorder.next_step()
    (site,) = recorder.sites
    assert site.site == ("/work/project/train.py", 42, "step")
    assert (site.bytes, site.count) == (2048, 2)
    # History on for the steps, off again after.
    assert calls[0][1]["stacks"] == "python" and calls[-1][1] == {"enabled": None}
    assert len(survivors_in_snapshot(snapshot(), 0, 0)) == 3


# -- the peak's breakdown ----------------------------------------------------------------------


def _gpt() -> Any:
    sys.path.insert(0, str(SUITES))
    try:
        import gpt
    finally:
        sys.path.remove(str(SUITES))
    return gpt


def test_a_training_steps_peak_is_broken_down_like_memtracker_does() -> None:
    gpt = _gpt()
    config = gpt.GPTConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4)
    backend = SimBackend()
    backend.begin_test()
    breakdown = PeakBreakdown(backend.tracker)
    breakdown.start()
    try:
        model = gpt.GPT(config).to("cuda")
        optimizer = torch.optim.AdamW(model.parameters())
        # Activations of 16 x 256 tokens outweigh the optimizer's first step: the peak is in
        # the second step's forward.
        tokens = torch.randint(0, 512, (16, 257), device="cuda")
        for _ in range(2):
            gpt.training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
        result = breakdown.result(backend.peak_allocated())
    finally:
        breakdown.stop()
        backend.end_test()
    params = sum(backend.storage_bytes(p) or 0 for p in model.parameters())
    categories = result["categories"]
    assert result["total"] == backend.peak_allocated() == sum(categories.values())
    assert categories["parameters"] == params
    assert categories["optimizer"] >= 2 * params - 512 * 4  # AdamW's two moments (and steps)
    assert categories["activations"] > 0
    names = [module["name"] for module in result["modules"]]
    assert {"blocks.0", "blocks.1", "embed"} <= set(names)
    block = next(m for m in result["modules"] if m["name"] == "blocks.0")
    assert block["categories"]["parameters"] > 0 and block["categories"]["activations"] > 0
    # The hooks are gone again.
    assert backend.tracker.listeners == ()
    assert not torch.nn.modules.module._global_forward_pre_hooks


def _broken_down_gpt_steps(source: str) -> dict[str, Any]:
    """Two GPT training steps computing on the simulated device, broken down from the op
    counter's log (``log``), from the tracker (``tracker``), or from the log until the second
    step, where a listener moves the test to the tracker (``log-then-tracker``)."""
    gpt = _gpt()
    config = gpt.GPTConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4)
    with simulated(computing=True, workspaces=True) as backend:
        log = backend.allocation_log()
        if log is None:
            pytest.skip("the op counter is unavailable here: computing tests count in Python")
        breakdown = PeakBreakdown(backend.tracker if source == "tracker" else log)
        breakdown.start()
        try:
            torch.manual_seed(0)
            model = gpt.GPT(config).to("cuda")
            optimizer = torch.optim.AdamW(model.parameters())
            tokens = torch.randint(0, 512, (16, 257), device="cuda")
            for step in range(2):
                if step == 1 and source == "log-then-tracker":
                    tracker = backend.tracker
                    listener = LeakSiteRecorder(backend)  # hears each allocation in Python
                    tracker.add_listener(listener)
                gpt.training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
            result = breakdown.result(backend.peak_allocated())
            peak = backend.peak_allocated()
        finally:
            breakdown.stop()
            if source == "log-then-tracker":
                tracker.remove_listener(listener)
    result["peak"] = peak
    return result


def test_a_computing_tests_breakdown_from_the_op_counters_log_is_the_trackers() -> None:
    # Counting in PyTorch's allocator, the test's peak breaks down to the same bytes, category
    # by category and module by module, as when every op is counted in Python.
    from_log = _broken_down_gpt_steps("log")
    from_tracker = _broken_down_gpt_steps("tracker")
    assert from_log == from_tracker
    categories = from_log["categories"]
    assert from_log["total"] == from_log["peak"] == sum(categories.values())
    assert categories["parameters"] > 0 and categories["activations"] > 0
    assert categories["optimizer"] > 0 and categories["cublas_workspaces"] > 0


def test_a_breakdown_goes_on_when_a_listener_moves_the_test_to_the_tracker() -> None:
    # A leak check's recorder needs every allocation in Python: the test moves to the tracker
    # midway, and the breakdown still hears the whole test: all of its peak is attributed.
    # (The tracker lays its blocks out on segments of its own, where the op counter's cached
    # ones are not to be had: the second step's blocks, and so its peak, may differ a little.)
    moved = _broken_down_gpt_steps("log-then-tracker")
    categories = moved["categories"]
    assert moved["total"] == moved["peak"] == sum(categories.values())
    assert categories["other"] == 0
    assert categories["activations"] > 100 * 2**20  # the second step's forward, on the tracker
    from_tracker = _broken_down_gpt_steps("tracker")
    for name in ("parameters", "gradients", "optimizer", "cublas_workspaces"):
        assert categories[name] == from_tracker["categories"][name]
    # The peak is of what both counts held at once, not the sum of their peaks.
    assert abs(moved["peak"] - from_tracker["peak"]) < from_tracker["peak"] // 100


def test_growth_names_the_categories_that_grew() -> None:
    before = {"parameters": 100, "gradients": 100, "optimizer": 200, "activations": 10 << 20}
    after = dict(before, activations=(10 << 20) + 10158080)
    assert describe_growth(after, before) == (
        "activations +9.69 MiB; parameters, gradients, optimizer unchanged"
    )
    assert entry_categories({"peak_allocated": 5}) is None
    # An entry names the categories that held memory; the others held none.
    assert entry_categories({"peak_activations": 5}) == {
        "parameters": 0,
        "gradients": 0,
        "optimizer": 0,
        "activations": 5,
        "temporaries": 0,
        "cublas_workspaces": 0,
        "other": 0,
    }


STEP = """
import os
import torch
from pytest_vram import max_vram

BATCH = int(os.environ.get("BATCH", "64"))

@max_vram(os.environ.get("BUDGET", "1GB"))
def test_step(vram):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512)
    ).to(vram.device)
    batch = torch.randn(BATCH, 512, device=vram.device)
    model(batch).square().mean().backward()
"""


@pytest.mark.parametrize("options", BACKENDS)
def test_a_regression_says_which_categories_grew(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, options: list[str]
) -> None:
    pytester.makepyfile(test_step=STEP)
    # No option needed: every sim and cpu test stores its peak's categories.
    pytester.runpytest(*options, "--vram-update-baselines").assert_outcomes(passed=1)
    (baseline,) = (pytester.path / "baselines").glob("*.yaml")
    stored = baseline.read_text()
    # At 64 rows the peak comes in backward, after the activations are gone: no line for them.
    assert "peak_parameters:" in stored and "peak_activations:" not in stored
    # A growth beyond the 5% tolerance with the 64 MiB of cuBLAS workspaces (two threads, as on
    # a Hopper GPU) that a training step's peak holds besides the model.
    monkeypatch.setenv("BATCH", "2048")
    result = pytester.runpytest(*options, "--vram-json=out.json")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            "memory regression: peak allocated *",
            "at the peak, against the baseline: activations +*; parameters* unchanged",
        ]
    )
    (test,) = json.loads((pytester.path / "out.json").read_text())["tests"]
    assert test["categories"]["activations"] > 0
    assert "breakdown" not in test or test["breakdown"] is None  # modules only when asked


def test_a_computing_test_stores_the_same_categories_as_counted_in_python(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A computing test counts in PyTorch's allocator, and its categories come from the op
    # counter's log; with a capacity (whose out-of-memory only the tracker raises) every op is
    # counted in Python. The figures stored are the same.
    pytester.makepyfile(test_step=STEP)
    monkeypatch.setenv("BATCH", "2048")
    stored = []
    for extra in ([], ["--vram-sim-capacity=80GB"]):
        options = ["--vram-backend=sim", "--vram-sim-compute=always", "--vram-json=out.json"]
        pytester.runpytest(*options, *extra).assert_outcomes(passed=1)
        (test,) = json.loads((pytester.path / "out.json").read_text())["tests"]
        stored.append((test["peak_allocated"], test["categories"]))
    assert stored[0] == stored[1]
    peak, categories = stored[0]
    assert sum(categories.values()) == peak and categories["other"] == 0
    # Two 4 MiB weights and biases of 8 KiB and 2 KiB, as the model's parameters.
    assert categories["parameters"] == 2 * 512 * 2048 * 4 + 2048 * 4 + 512 * 4
    assert categories["activations"] > 0 and categories["cublas_workspaces"] > 0


@pytest.mark.parametrize("options", BACKENDS)
def test_a_budget_failure_says_what_the_peak_held(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, options: list[str]
) -> None:
    pytester.makepyfile(test_step=STEP)
    monkeypatch.setenv("BUDGET", "1MB")
    monkeypatch.setenv("BATCH", "2048")
    result = pytester.runpytest(*options)
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["peak allocated memory * exceeds max_vram(*", "at the peak: *activations *MiB*"]
    )
    # The modules are named only under --vram-breakdown.
    assert "largest modules" not in result.stdout.str()


def test_a_budget_failure_without_a_baseline_shows_the_breakdown(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(test_step=STEP)
    monkeypatch.setenv("BUDGET", "1MB")
    result = pytester.runpytest("--vram-backend=sim", "--vram-breakdown", "--vram-html=r.html")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        ["peak allocated memory * exceeds max_vram(*", "at the peak: *parameters *MiB*"]
    )
    html = (pytester.path / "r.html").read_text()
    assert "What the peaks were made of" in html and "Sequential.0" in html


@pytest.mark.parametrize("options", BACKENDS)
def test_old_baseline_entries_without_categories_still_compare(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, options: list[str]
) -> None:
    pytester.makepyfile(test_step=STEP)
    pytester.runpytest(*options, "--vram-update-baselines").assert_outcomes(passed=1)
    (baseline,) = (pytester.path / "baselines").glob("*.yaml")
    # An entry as versions before the category totals wrote it.
    lines = baseline.read_text().splitlines(keepends=True)
    old = [line for line in lines if line.strip().split(":")[0] not in CATEGORY_FIGURES]
    assert len(old) < len(lines)
    baseline.write_text("".join(old))
    # A growth beyond the 5% tolerance with the 64 MiB of cuBLAS workspaces (two threads, as on
    # a Hopper GPU) that a training step's peak holds besides the model.
    monkeypatch.setenv("BATCH", "2048")
    result = pytester.runpytest(*options)
    result.assert_outcomes(failed=1)
    # Nothing to compare the categories with: what the peak held is shown as it is.
    result.stdout.fnmatch_lines(["memory regression: peak allocated *", "at the peak: *"])
    assert "against the baseline:" not in result.stdout.str()


def test_records_store_the_categories_that_held_memory() -> None:
    record = TestRecord("t", "sim", "sim", peak_allocated=10)
    assert "peak_activations" not in record.figures()  # none taken (cuda, unless asked)
    record.breakdown = {"categories": {"activations": 7, "parameters": 3, "gradients": 0}}
    figures = record.figures()
    assert figures == {"peak_allocated": 10, "peak_activations": 7, "peak_parameters": 3}
    assert TestRecord.from_dict(record.to_dict()).breakdown == record.breakdown
    # Categories taken on their own, as every sim and cpu test takes them.
    record = TestRecord("t", "sim", "sim", peak_allocated=0, categories={"activations": 0})
    assert record.figures() == {"peak_allocated": 0, "peak_other": 0}
    assert TestRecord.from_dict(record.to_dict()).categories == record.categories


# -- snapshots -----------------------------------------------------------------------------------


def _memory_viz(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "torch.cuda._memory_viz", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
@pytest.mark.parametrize("options", BACKENDS)
def test_snapshot_on_fail_is_read_by_pytorchs_memory_viz(
    pytester: pytest.Pytester, options: list[str]
) -> None:
    pytester.makepyfile(
        test_fails="""
import torch

def test_fails(vram):
    kept = [torch.ones(1 << 18, device=vram.device) for _ in range(4)]
    del kept[1]
    assert False
"""
    )
    result = pytester.runpytest(*options, "--vram-snapshot-on-fail=snaps")
    result.assert_outcomes(failed=1)
    name = snapshot_name("test_fails.py::test_fails")
    result.stdout.fnmatch_lines([f"*allocator snapshot: snaps/{name}"])
    path = pytester.path / "snaps" / name
    snapshot = pickle.loads(path.read_bytes())
    trace = snapshot["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc" and e["size"] >= 1 << 20]
    assert len(allocs) == 4
    assert any(
        f["filename"].endswith("test_fails.py") and f["line"] == 4 for f in allocs[0]["frames"]
    )
    assert [e["action"] for e in trace].count("free_completed") >= 1
    live = [
        b for s in snapshot["segments"] for b in s["blocks"] if b["state"] == "active_allocated"
    ]
    assert sum(b["size"] for b in live if b["size"] >= 1 << 20) == 3 << 20
    for command in (
        ["trace_plot", str(path), "-o", "trace.html"],
        ["segment_plot", str(path), "-o", "segments.html"],
    ):
        done = _memory_viz(*command, cwd=pytester.path)
        assert done.returncode == 0, done.stderr
        assert "snapshot.pickle" in (pytester.path / command[-1]).read_text()
    # The flamegraphs' reading of the snapshot (their SVG needs flamegraph.pl from the network).
    from torch.cuda import _memory_viz as memory_viz

    for render in (memory_viz.memory, memory_viz.segments):
        lines = render(snapshot, format_flamegraph=lambda text: text)
        assert "test_fails.py" in lines
    for command in ("stats", "trace"):
        done = _memory_viz(command, str(path), cwd=pytester.path)
        assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_a_simulated_training_step_becomes_a_timeline(pytester: pytest.Pytester) -> None:
    pytester.syspathinsert(SUITES)
    pytester.makepyfile(
        test_train="""
import torch
from gpt import GPT, GPTConfig, training_step

def test_step(vram):
    config = GPTConfig(vocab_size=512, hidden_size=128, num_layers=2, num_heads=4)
    model = GPT(config).cuda()
    optimizer = torch.optim.AdamW(model.parameters())
    tokens = torch.randint(0, 512, (2, 65), device="cuda")
    training_step(model, optimizer, tokens[:, :-1], tokens[:, 1:])
    assert False, "to get a snapshot"
"""
    )
    result = pytester.runpytest("--vram-backend=sim", "--vram-snapshot-on-fail=snaps")
    result.assert_outcomes(failed=1)
    (path,) = (pytester.path / "snaps").iterdir()
    snapshot = pickle.loads(path.read_bytes())
    trace = snapshot["device_traces"][0]
    actions = {e["action"] for e in trace}
    assert {"alloc", "free_requested", "free_completed", "segment_alloc"} <= actions
    files = {Path(f["filename"]).name for e in trace for f in e["frames"]}
    assert {"gpt.py", "test_train.py"} <= files
    # Addresses are the simulated allocator's: every live block lies in a segment.
    for segment in snapshot["segments"]:
        assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]
    done = _memory_viz("trace_plot", str(path), "-o", "trace.html", cwd=pytester.path)
    assert done.returncode == 0, done.stderr


def test_the_default_path_attaches_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain(vram):\n    import torch\n    torch.ones(8)\n")
    pytester.runpytest("--vram-backend=sim", "--vram-report").assert_outcomes(passed=1)
    assert not torch.nn.modules.module._global_forward_pre_hooks
    from torch.optim import optimizer

    assert not optimizer._global_optimizer_pre_hooks
