"""pytest-benchmark integration: memory figures in extra_info, rounds that start clean.

The end-to-end tests run pytest-benchmark for real through pytester, on the sim and cpu
backends; the unit tests drive BenchmarkRounds with a stand-in for the benchmark fixture, to
see where the release and the collection fall relative to the timed region.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fake_gpu import FakeAllocator

from pytest_vram.backends.base import Backend
from pytest_vram.backends.cuda.backend import CudaBackend
from pytest_vram.measure.measurement import TestMeasurement
from pytest_vram.record.record import TestRecord
from pytest_vram.wiring.benchmarking import BenchmarkRounds

pytest_plugins = ["fake_gpu_fixtures"]

MiB = 1024 * 1024
QUICK = ("--benchmark-max-time=0.02", "--benchmark-min-rounds=3", "-p", "no:cacheprovider")

ALLOCATES = """
import gc
import pytest
import torch
from pytest_vram import max_vram

def make():
    return torch.ones(1024 * 1024, device=DEVICE)  # 4 MiB

@max_vram("1GB")
def test_marked(benchmark):
    benchmark(make)

def test_fixture(benchmark, vram):
    benchmark(make)

def test_plain(benchmark):
    # Unmeasured unless --vram-report: plain torch, on the host.
    benchmark(lambda: torch.ones(1024 * 1024))
"""


@pytest.fixture(autouse=True)
def not_an_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    """pytest-benchmark turns itself off in an xdist worker's environment, which the inner
    runs would inherit when these tests run under -n."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


def benchmarks(path: Path) -> dict[str, dict[str, Any]]:
    data = json.loads(path.read_text())
    return {bench["name"]: bench for bench in data["benchmarks"]}


@pytest.mark.parametrize(("backend", "device"), [("sim", '"cuda"'), ("cpu", '"cpu"')])
def test_benchmark_json_carries_the_vram_figures(
    pytester: pytest.Pytester, backend: str, device: str
) -> None:
    pytester.makepyfile(ALLOCATES.replace("DEVICE", device))
    result = pytester.runpytest(f"--vram-backend={backend}", "--benchmark-json=bench.json", *QUICK)
    result.assert_outcomes(passed=3)
    found = benchmarks(pytester.path / "bench.json")
    for name in ("test_marked", "test_fixture"):
        info = found[name]["extra_info"]
        assert info["vram_backend"] == backend
        assert info["vram_device"] == backend
        assert info["vram_status"] == "new"
        assert info["vram_peak_allocated"] == 4 * MiB
        assert info["vram_peak_increment"] == 4 * MiB
        assert info["vram_leftover"] == 0
        assert info["vram_round_peak"] == 4 * MiB
        assert info["vram_round_increment"] == 4 * MiB
        assert info["vram_runs"] >= 3  # calibration and the timed rounds
        assert all(isinstance(v, int) for k, v in info.items() if k.startswith("vram_peak"))
        if backend == "sim":
            assert info["vram_peak_reserved"] >= 4 * MiB
    # Not measured without a marker, the vram fixture or --vram-report.
    assert found["test_plain"]["extra_info"] == {}


def test_benchmark_measured_under_vram_report(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ALLOCATES.replace("DEVICE", '"cuda"'))
    result = pytester.runpytest(
        "--vram-backend=sim",
        "--vram-report",
        "--vram-gate=all",  # the simulated device runs a plain test only then
        "--benchmark-json=bench.json",
        *QUICK,
    )
    result.assert_outcomes(passed=3)
    info = benchmarks(pytester.path / "bench.json")["test_plain"]["extra_info"]
    assert info["vram_peak_allocated"] == 4 * MiB
    assert info["vram_backend"] == "sim"


def test_benchmark_extra_info_keeps_the_tests_own_keys(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch

        def test_bench(benchmark, vram):
            benchmark.extra_info["model"] = "tiny"
            benchmark.pedantic(lambda: torch.ones(256, device="cuda"), rounds=4)
        """
    )
    result = pytester.runpytest("--vram-backend=sim", "--benchmark-json=bench.json", *QUICK)
    result.assert_outcomes(passed=1)
    info = benchmarks(pytester.path / "bench.json")["test_bench"]["extra_info"]
    assert info["model"] == "tiny"
    # pedantic holds each round's return value until the next round has returned its own.
    assert info["vram_peak_allocated"] == 2 * 1024
    assert info["vram_round_increment"] == 1024
    assert info["vram_runs"] == 4


def test_benchmark_budget_failure_is_in_extra_info(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import torch
        from pytest_vram import max_vram

        @max_vram("1MiB")
        def test_over(benchmark):
            benchmark.pedantic(lambda: torch.ones(1024 * 1024, device="cuda"), rounds=2)
        """
    )
    result = pytester.runpytest("--vram-backend=sim", "--benchmark-json=bench.json", *QUICK)
    result.assert_outcomes(failed=1)
    info = benchmarks(pytester.path / "bench.json")["test_over"]["extra_info"]
    assert info["vram_status"] == "over-budget"
    assert info["vram_peak_allocated"] == 2 * 4 * MiB  # pedantic holds the previous result
    assert info["vram_round_increment"] == 4 * MiB


GARBAGE = """
import gc
import torch

def leave_garbage():
    x = torch.ones(1024 * 1024, device=DEVICE)  # 4 MiB, kept alive by a reference cycle
    cycle = [x]
    cycle.append(cycle)

def test_rounds(benchmark, vram):
    gc.disable()  # as a test that allocates few Python objects would see it: no collection
    try:
        benchmark.pedantic(leave_garbage, rounds=20, iterations=1)
    finally:
        gc.enable()

def test_looped_rounds(benchmark, vram):
    benchmark(leave_garbage)
"""


@pytest.mark.parametrize(("backend", "device"), [("sim", '"cuda"'), ("cpu", '"cpu"')])
def test_benchmark_rounds_do_not_accumulate_garbage(
    pytester: pytest.Pytester, backend: str, device: str
) -> None:
    pytester.makepyfile(GARBAGE.replace("DEVICE", device))
    args = (f"--vram-backend={backend}", "--vram-json=vram.json", "--benchmark-disable-gc", *QUICK)
    result = pytester.runpytest("--benchmark-json=bench.json", *args)
    result.assert_outcomes(passed=2)
    found = benchmarks(pytester.path / "bench.json")
    for name in ("test_rounds", "test_looped_rounds"):
        info = found[name]["extra_info"]
        # One round's worth (a looped round calls the function `iterations` times).
        per_round = 4 * MiB * found[name]["stats"]["iterations"]
        assert info["vram_round_increment"] == per_round, name
        assert info["vram_peak_allocated"] <= per_round + 4 * MiB, name  # + the result call
        assert info["vram_leftover"] == 0

    # Without the integration the same rounds pile up: 20 rounds, 20 garbage tensors.
    result = pytester.runpytest("-p", "no:vram-benchmark", "--benchmark-json=off.json", *args)
    result.assert_outcomes(passed=2)
    assert benchmarks(pytester.path / "off.json")["test_rounds"]["extra_info"] == {}
    tests = json.loads((pytester.path / "vram.json").read_text())["tests"]
    peaks = {test["nodeid"].split("::")[-1]: test["peak_allocated"] for test in tests}
    assert peaks["test_rounds"] >= 20 * 4 * MiB


def test_benchmark_autosave_and_compare_carry_the_figures(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ALLOCATES.replace("DEVICE", '"cuda"'))
    storage = pytester.path / "bench-store"
    result = pytester.runpytest(
        "--vram-backend=sim",
        "--benchmark-autosave",
        f"--benchmark-storage=file://{storage}",
        *QUICK,
    )
    result.assert_outcomes(passed=3)
    (saved,) = storage.rglob("*.json")
    info = benchmarks(saved)["test_fixture"]["extra_info"]
    assert info["vram_peak_allocated"] == 4 * MiB
    assert info["vram_device"] == "sim"

    command = shutil.which("pytest-benchmark") or str(
        Path(sys.executable).with_name("pytest-benchmark")
    )
    compare = subprocess.run(
        [command, "--storage", f"file://{storage}", "compare", str(saved)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert compare.returncode == 0, compare.stderr
    assert "test_fixture" in compare.stdout


def test_benchmark_integration_under_xdist(pytester: pytest.Pytester) -> None:
    # The xdist controller collects nothing (pytest 7 gives its session no ``items``); the
    # workers measure, and pytest-benchmark turns its timing off there.
    pytest.importorskip("xdist")
    pytester.makepyfile(
        """
        import torch

        def test_measured(vram):
            torch.ones(1024, device=vram.device)

        def test_timed(benchmark):
            benchmark(lambda: None)
        """
    )
    result = pytester.runpytest_subprocess(
        "-p", "xdist", "-n", "2", "--vram-backend=sim", "--vram-report", *QUICK
    )
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*test_measured*sim*4.00 KiB*"])


def test_benchmark_integration_registered_only_for_benchmark_tests(
    pytester: pytest.Pytester,
) -> None:
    pytester.makeconftest(
        """
        def pytest_sessionfinish(session):
            manager = session.config.pluginmanager
            print("vram-benchmark registered:", manager.has_plugin("vram-benchmark"))
        """
    )
    pytester.makepyfile(
        """
        def test_measured(vram):
            pass
        """
    )
    result = pytester.runpytest("-s", "-p", "no:benchmark", "--vram-backend=sim")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*vram-benchmark registered: False*"])
    # With pytest-benchmark but no test that uses its fixture, there is nothing to do.
    result = pytester.runpytest("-s", "--vram-backend=sim")
    result.stdout.fnmatch_lines(["*vram-benchmark registered: False*"])
    pytester.makepyfile(
        test_timed="""
        def test_timed(vram, benchmark):
            benchmark(lambda: None)
        """
    )
    result = pytester.runpytest("-s", "--vram-backend=sim")
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*vram-benchmark registered: True*"])


# -- where the release and the collection fall ----------------------------------------------


class EventBackend(Backend):
    """Counts allocations a test sets by hand and logs every release."""

    name = "events"

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.now = 0
        self.peak = 0
        self.cached = 0

    def allocated(self) -> int:
        return self.now

    def peak_allocated(self) -> int:
        return self.peak

    def reset_peak(self) -> None:
        self.peak = self.now

    def reserved(self) -> int | None:
        return self.now + self.cached

    def release_cache(self) -> None:
        self.events.append("release")
        self.cached = 0


class FakeBenchmark:
    """pytest-benchmark's fixture as far as BenchmarkRounds uses it: the runner times its
    loop between two timer readings."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.extra_info: dict[str, Any] = {}

    def _make_runner(self, function: Callable[[], Any], args: Any, kwargs: Any) -> Any:
        def runner(loops_range: Any, timer: Any = None) -> float:
            self.events.append("timer start")
            function(*args, **kwargs)
            self.events.append("timer end")
            return 0.0

        return runner


def test_benchmark_rounds_release_and_collect_outside_the_timed_region(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    backend = EventBackend(events)
    measurement = TestMeasurement(backend, "t.py::test_bench")
    measurement.begin()
    fixture = FakeBenchmark(events)
    rounds = BenchmarkRounds(measurement, fixture)
    monkeypatch.setattr("gc.collect", lambda generation=2: events.append(f"gc({generation})"))

    def step() -> None:
        backend.now += 100  # garbage the collection frees (the fake gc frees nothing)
        backend.peak = max(backend.peak, backend.now)
        backend.cached += 50

    for _ in range(2):
        fixture._make_runner(step, (), {})(range(1))
    assert events == [
        "timer start", "timer end", "gc(1)",
        "release", "timer start", "timer end", "gc(1)", "gc(2)",
    ]  # fmt: skip
    assert rounds.runs == 2
    assert rounds.round_increment == 100
    assert rounds.round_peak == 200


def test_benchmark_rounds_skip_work_when_a_round_leaves_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    backend = EventBackend(events)
    measurement = TestMeasurement(backend, "t.py::test_bench")
    measurement.begin()
    fixture = FakeBenchmark(events)
    BenchmarkRounds(measurement, fixture)
    monkeypatch.setattr("gc.collect", lambda generation=2: events.append("gc"))
    for _ in range(3):
        fixture._make_runner(lambda: None, (), {})(range(1))
    assert "gc" not in events
    assert "release" not in events


def test_benchmark_extra_info_figures_are_the_records() -> None:
    events: list[str] = []
    measurement = TestMeasurement(EventBackend(events), "t.py::test_bench")
    rounds = BenchmarkRounds(measurement, FakeBenchmark(events))
    record = TestRecord(
        nodeid="t.py::test_bench", backend="cuda", device="NVIDIA H100 80GB HBM3",
        peak_allocated=3 * MiB, peak_reserved=4 * MiB, peak_device=5 * MiB, status="ok",
        baseline={"peak_allocated": 3 * MiB},
    )  # fmt: skip
    rounds.write(record)
    info = rounds.fixture.extra_info
    assert info["vram_backend"] == "cuda"
    assert info["vram_device"] == "NVIDIA H100 80GB HBM3"
    assert info["vram_peak_allocated"] == 3 * MiB
    assert info["vram_peak_reserved"] == 4 * MiB
    assert info["vram_peak_device"] == 5 * MiB
    assert info["vram_baseline"] == 3 * MiB
    assert info["vram_status"] == "ok"


def test_fake_cuda_benchmark_rounds_keep_cublas_workspaces(
    fake_cuda: FakeAllocator, no_pynvml: None
) -> None:
    backend = CudaBackend()
    try:
        measurement = TestMeasurement(backend, "t.py::test_bench")
        measurement.begin()
        fixture = FakeBenchmark([])

        def step() -> None:
            fake_cuda.malloc(3 * MiB)
            fake_cuda.free(3 * MiB)  # leaves a cached segment

        BenchmarkRounds(measurement, fixture)
        fixture._make_runner(step, (), {})(range(1))
        fake_cuda.calls.clear()
        fixture._make_runner(step, (), {})(range(1))
        assert "empty_cache" in fake_cuda.calls
        assert fake_cuda.calls.index("synchronize") < fake_cuda.calls.index("empty_cache")
        assert "clear_cublas_workspaces" not in fake_cuda.calls
        measurement.end()
    finally:
        backend.close()
