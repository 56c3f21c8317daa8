"""The GPU check (scripts/gpu-check.sh): its tables, its snapshot loader, and a dry run of the
whole script on this machine's CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu-check.sh"
STAGES = [
    "device", "install", "cuda-tests", "suites-cuda", "overhead", "oom", "snapshot", "suites-sim",
    "ratios", "outputs",
]  # fmt: skip


def _script(name: str) -> ModuleType:
    """A helper of the check, imported from scripts/ as the script runs it."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
    return sys.modules[name]


sim_vs_cuda = _script("sim_vs_cuda")
snapshots = _script("gpu_check_snapshot")
overhead = _script("gpu_check_overhead")
oom = _script("gpu_check_oom")
install = _script("gpu_check_install")


def _report(path: Path, tests: list[dict]) -> str:
    path.write_text(json.dumps({"pytest_vram": "0.1.0", "tests": tests}), encoding="utf-8")
    return str(path)


def _test(nodeid: str, backend: str, allocated=None, reserved=None, device=None) -> dict:
    return {
        "nodeid": nodeid,
        "backend": backend,
        "peak_allocated": allocated,
        "peak_reserved": reserved,
        "peak_device": device,
    }


@pytest.fixture
def reports(tmp_path: Path) -> tuple[str, str]:
    """A sim run and a cuda run of the same suite: two tests on the backend each run chose,
    one pinned to sim by a marker in both, and one test that ran in only one of them."""
    sim = _report(
        tmp_path / "sim.json",
        [
            _test("t.py::test_a", "sim", allocated=110 * 2**20, reserved=200 * 2**20),
            _test("t.py::test_b", "sim", allocated=50 * 2**20, reserved=64 * 2**20),
            _test("t.py::test_pinned", "sim", allocated=1, reserved=1),
            _test("t.py::test_only_sim", "sim", allocated=1, reserved=1),
        ],
    )
    cuda = _report(
        tmp_path / "cuda.json",
        [
            _test("t.py::test_a", "cuda", 100 * 2**20, 200 * 2**20, device=700 * 2**20),
            _test("t.py::test_b", "cuda", allocated=50 * 2**20),
            _test("t.py::test_pinned", "sim", allocated=1, reserved=1),
            _test("t.py::test_only_cuda", "cuda", allocated=1, reserved=2),
        ],
    )
    return sim, cuda


def test_ratios_cover_the_tests_that_ran_on_cuda_and_on_sim(reports) -> None:
    sim, cuda = (sim_vs_cuda.load_tests(path) for path in reports)
    rows = sim_vs_cuda.compare(sim, cuda)
    assert [row.nodeid for row in rows] == ["t.py::test_a", "t.py::test_b"]
    assert rows[0].allocated_ratio == pytest.approx(1.1)
    assert rows[0].reserved_ratio == 1.0
    assert rows[1].allocated_ratio == 1.0
    assert rows[1].reserved_ratio is None  # no reserved figure on cuda


def test_ratio_table(reports) -> None:
    sim, cuda = (sim_vs_cuda.load_tests(path) for path in reports)
    lines = sim_vs_cuda.ratio_table(sim_vs_cuda.compare(sim, cuda))
    assert lines[0].split() == [
        "test", "allocated", "sim", "cuda", "sim/cuda", "reserved", "sim", "cuda", "sim/cuda",
    ]  # fmt: skip
    assert lines[1].split() == [
        "t.py::test_a", "110.00", "MiB", "100.00", "MiB", "1.1000", "200.00", "MiB", "200.00",
        "MiB", "1.0000",
    ]  # fmt: skip
    # No reserved figure on cuda: no ratio either.
    assert lines[2].split() == [
        "t.py::test_b", "50.00", "MiB", "50.00", "MiB", "1.0000", "64.00", "MiB", "-", "-",
    ]  # fmt: skip
    assert lines[3:] == [
        "2 tests on both cuda and sim",
        "allocated sim/cuda: median 1.0500, from 1.0000 to 1.1000, largest deviation +10.00% "
        "(2 tests)",
        "reserved sim/cuda: median 1.0000, from 1.0000 to 1.0000, largest deviation +0.00% "
        "(1 test)",
    ]


def test_device_peaks_beside_allocator_peaks(reports) -> None:
    cuda = sim_vs_cuda.load_tests(reports[1])
    lines = sim_vs_cuda.device_table(cuda)
    assert lines[0].split() == ["test", "allocated", "reserved", "device", "(NVML)", "device", "-",
                                "reserved"]  # fmt: skip
    rows = {line.split()[0]: line.split()[1:] for line in lines[1:]}
    # test_pinned ran on sim: not a GPU figure.
    assert set(rows) == {"t.py::test_a", "t.py::test_b", "t.py::test_only_cuda"}
    assert rows["t.py::test_a"] == ["100.00", "MiB", "200.00", "MiB", "700.00", "MiB", "500.00",
                                    "MiB"]  # fmt: skip
    assert rows["t.py::test_b"] == ["50.00", "MiB", "-", "-", "-"]


def test_device_table_says_when_nvml_measured_nothing(tmp_path: Path) -> None:
    path = _report(tmp_path / "cuda.json", [_test("t.py::test_a", "cuda", 1024, 2048)])
    lines = sim_vs_cuda.device_table(sim_vs_cuda.load_tests(path))
    assert lines[-1] == "NVML measured no device peak (no NVML here, or no sample)"


def test_sim_vs_cuda_command(reports, capsys: pytest.CaptureFixture[str]) -> None:
    assert sim_vs_cuda.main(list(reports)) == 0
    out = capsys.readouterr().out
    assert "sim/cuda per test (allocator peaks)" in out
    assert "cuda: allocator peaks beside the device's (NVML)" in out
    # The same file twice: no test ran on cuda in it, so there is nothing to compare.
    assert sim_vs_cuda.main([reports[0], reports[0]]) == 1
    assert "no test ran both on cuda and on sim" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read: No such file or directory"),
        ("{not json", "not JSON: "),
        ('{"totals": {}}', "no 'tests' list: not a --vram-json report"),
        ('{"tests": [{"peak_allocated": 1}]}', "tests[0] has no node id"),
    ],
)
def test_sim_vs_cuda_names_the_file_it_cannot_read(
    tmp_path: Path, reports, capsys: pytest.CaptureFixture[str], content, message
) -> None:
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content, encoding="utf-8")
    assert sim_vs_cuda.main([str(bad), reports[1]]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"sim_vs_cuda: {bad}: {message}")
    assert "Traceback" not in err


SNAPSHOT = {
    "segments": [{"device": 0, "address": 1 << 20, "total_size": 20 * 2**20, "blocks": []}],
    "device_traces": [
        [
            {"action": "segment_alloc", "addr": 1 << 20, "size": 20 * 2**20, "frames": []},
            {"action": "alloc", "addr": 1 << 20, "size": 4 * 2**20, "frames": []},
            {"action": "free_requested", "addr": 1 << 20, "size": 4 * 2**20, "frames": []},
        ]
    ],
    "allocator_settings": {"expandable_segments": False},
}


class _Touch:
    """Unpickling it creates a file: what a hostile snapshot could do."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_the_snapshot_loader_reads_plain_data(tmp_path: Path) -> None:
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(pickle.dumps(SNAPSHOT))
    loaded = snapshots.load_snapshot(path)
    assert loaded == SNAPSHOT
    assert snapshots.allocations(loaded) == [4 * 2**20]


def test_the_snapshot_loader_refuses_every_global(tmp_path: Path) -> None:
    touched = tmp_path / "touched"
    payload = pickle.dumps({**SNAPSHOT, "extra": _Touch(touched)})
    pickle.loads(payload)  # what an ordinary unpickler does with it
    assert touched.exists()
    touched.unlink()

    path = tmp_path / "hostile.pickle"
    path.write_bytes(payload)
    with pytest.raises(snapshots.SnapshotError) as excinfo:
        snapshots.load_snapshot(path)
    assert str(excinfo.value) == (
        f"{path}: not a plain-data pickle: refused the global pathlib.Path.touch: only plain "
        "data loads"
    )
    assert not touched.exists()
    # Even a harmless class is a global.
    with pytest.raises(pickle.UnpicklingError, match="refused the global collections"):
        snapshots.loads(pickle.dumps({"segments": __import__("collections").OrderedDict()}))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a plain-data pickle: "),
        (pickle.dumps([1, 2]), "a list, not a snapshot dict"),
        (pickle.dumps({"segments": []}), "no 'device_traces' list: not a PyTorch memory snapshot"),
    ],
)
def test_the_snapshot_loader_names_the_file(tmp_path: Path, data: bytes, message: str) -> None:
    path = tmp_path / "snapshot.pickle"
    path.write_bytes(data)
    with pytest.raises(snapshots.SnapshotError, match=re.escape(f"{path}: {message}")):
        snapshots.load_snapshot(path)


def test_overhead_is_the_difference_of_the_medians_without_the_first_test() -> None:
    # The first test of each run pays for starting the backend once.
    result = overhead.overhead([0.9, 0.001, 0.002, 0.003], [2.0, 0.004, 0.005, 0.006])
    assert (result.plain, result.measured) == (0.002, 0.005)
    assert result.per_test == pytest.approx(0.003)
    assert result.ratio == pytest.approx(2.5)
    assert overhead.describe(result, 3) == [
        "3 small tests, median per test: plain 2.000 ms, --vram-report 5.000 ms",
        "overhead per measured test: +3.000 ms (--vram-report / plain: 2.50x)",
    ]
    with pytest.raises(ValueError, match="too few timed tests: 1 plain, 4 measured"):
        overhead.overhead([0.1], [0.1, 0.1, 0.1, 0.1])


def test_oom_check_wants_an_oom_then_a_clean_start() -> None:
    good = {
        oom.OOM_TEST: {"nodeid": oom.OOM_TEST, "status": "oom", "outcome": "failed"},
        oom.AFTER_TEST: {
            "nodeid": oom.AFTER_TEST,
            "status": "new",
            "outcome": "passed",
            "start_allocated": 0,
            "peak_allocated": oom.RECOVERY_BYTES,
        },
    }
    assert oom.check(good) == []
    failed = {**good[oom.OOM_TEST], "status": "failed"}
    leaked = {**good[oom.AFTER_TEST], "start_allocated": 2**30}
    assert oom.check({**good, oom.OOM_TEST: failed, oom.AFTER_TEST: leaked}) == [
        f"{oom.OOM_TEST}: status 'failed', expected 'oom'",
        f"{oom.AFTER_TEST}: started with {2**30} bytes",
    ]
    assert oom.check({oom.OOM_TEST: good[oom.OOM_TEST]}) == [f"no record of {oom.AFTER_TEST}"]


def _wheel(path: Path, files: dict[str, str]) -> Path:
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
    return path


def test_unpacking_a_wheel_without_pip(tmp_path: Path) -> None:
    site = tmp_path / "site"
    wheel = _wheel(
        tmp_path / "demo-1.0-py3-none-any.whl",
        {
            "demo/__init__.py": "",
            "demo-1.0.dist-info/entry_points.txt": "[pytest11]\ndemo = demo\n",
        },
    )
    assert install.unpack(wheel, site) == "demo"
    assert (site / "demo-1.0.dist-info" / "entry_points.txt").read_text().startswith("[pytest11]")
    hostile = _wheel(tmp_path / "evil-1.0-py3-none-any.whl", {"../evil.py": ""})
    with pytest.raises(ValueError, match=re.escape(f"{hostile}: unsafe path in the wheel: ../")):
        install.unpack(hostile, site)
    assert not (tmp_path / "evil.py").exists()


def test_a_wheel_built_before_the_checkout_changed_is_found(tmp_path: Path) -> None:
    installed, checkout = tmp_path / "site" / "pkg", tmp_path / "repo" / "pkg"
    for root in (installed, checkout):
        (root / "backends" / "__pycache__").mkdir(parents=True)
        (root / "__init__.py").write_text("", encoding="utf-8")
        (root / "backends" / "alloc.cpp").write_text("int x;", encoding="utf-8")
        (root / "backends" / "__pycache__" / "sim.cpython-311.pyc").write_bytes(root.name.encode())
    (root / "notes.txt").write_text("not a source", encoding="utf-8")
    assert install.stale_files(installed, checkout) == []

    (checkout / "backends" / "alloc.cpp").write_text("int y;", encoding="utf-8")
    (checkout / "backends" / "sim.py").write_text("", encoding="utf-8")  # new since the build
    (installed / "old.py").write_text("", encoding="utf-8")  # removed since
    assert install.stale_files(installed, checkout) == ["backends/alloc.cpp", "backends/sim.py",
                                                        "old.py"]  # fmt: skip


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60):
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
        timeout=timeout,
        check=False,
    )


def test_the_check_wants_an_empty_output_folder(tmp_path: Path) -> None:
    (tmp_path / "earlier.txt").write_text("kept", encoding="utf-8")
    done = _run("--dry-run", str(tmp_path))
    assert done.returncode == 2
    assert done.stderr == (
        f"gpu-check: {tmp_path} is not empty: the check writes its files into an empty folder\n"
    )
    assert [p.name for p in tmp_path.iterdir()] == ["earlier.txt"]


def test_the_check_refuses_a_bad_budget(tmp_path: Path) -> None:
    done = _run("--dry-run", str(tmp_path / "out"), env={"GPU_CHECK_BUDGET": "5min"})
    assert done.returncode == 2
    assert done.stderr == "gpu-check: GPU_CHECK_BUDGET=5min: expected whole seconds\n"


def test_every_stage_is_recorded_when_stages_fail(tmp_path: Path) -> None:
    """A stage out of time, an install without wheels, the stages after it not run, and a
    limit that is not a number: each in the summary, and the exit status 1."""
    out = tmp_path / "out"
    env = {
        "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),
        "TMPDIR": str(tmp_path),
        "PYTHON": sys.executable,
        "GPU_CHECK_TIMEOUT_DEVICE": "0.05",
        "GPU_CHECK_TIMEOUT_OUTPUTS": "soon",
    }
    done = _run("--dry-run", str(out), env=env)
    assert done.returncode == 1, done.stdout + done.stderr
    summary = (out / "summary.txt").read_text(encoding="utf-8")
    table = summary.split("\n\n")[1].splitlines()
    assert [line.split("  ")[0] for line in table] == ["stage", *STAGES]
    statuses = {line.split()[0]: re.split(r" {2,}", line)[1] for line in table[1:]}
    assert statuses == {
        "device": "timed out after 0.05 s",
        "install": "failed (exit 1)",
        **dict.fromkeys(STAGES[2:-1], "not run: the install failed"),
        "outputs": "not run: GPU_CHECK_TIMEOUT_OUTPUTS=soon is not seconds",
    }
    assert (
        f"{tmp_path}/no-wheels/pytest_vram-*.whl: no such wheel; run bash scripts/gpu-check.sh "
        "--prepare first"
    ) in summary
    assert sorted(p.name for p in out.iterdir()) == ["gpu-check.log", "summary.txt"]


@pytest.mark.slow
def test_dry_run(tmp_path: Path) -> None:
    """--prepare, then the dry run with the device stage given too little time: that stage
    times out, every other one passes, and the outputs are where the device machine takes them
    from."""
    wheels, out = tmp_path / "wheels", tmp_path / "out"
    env = {"GPU_CHECK_WHEELS": str(wheels), "TMPDIR": str(tmp_path), "PYTHON": sys.executable}
    prepared = _run("--prepare", env=env, timeout=300)
    assert prepared.returncode == 0, prepared.stdout + prepared.stderr
    assert sorted(p.name.split("-")[0] for p in wheels.iterdir()) == ["junitparser", "pytest_vram"]

    done = _run("--dry-run", str(out), env={**env, "GPU_CHECK_TIMEOUT_DEVICE": "0.05"}, timeout=600)
    summary = (out / "summary.txt").read_text(encoding="utf-8")
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert summary.splitlines()[:2] == [
        "pytest-vram GPU check: 1 of 10 stages did not pass: device",
        "dry run: cuda stages ran on sim",
    ], summary
    assert done.stdout.endswith(summary)  # printed too
    table = summary.split("\n\n")[1].splitlines()[1:]
    statuses = {line.split()[0]: re.split(r" {2,}", line)[1] for line in table}
    assert statuses == {"device": "timed out after 0.05 s", **dict.fromkeys(STAGES[1:], "ok")}, (
        summary
    )
    assert re.search(r"^total wall time: [\d.]+ s \(budget 460 s\)$", summary, flags=re.M)

    # The wheels, installed into the check's own environment.
    venv = r"/venv/lib/python3\.\d+/site-packages/"
    assert re.search(rf"^pytest_vram 0\.1\.0 from .*{venv}pytest_vram$", summary, flags=re.M)
    assert re.search(rf"^junitparser \S+ from .*{venv}junitparser$", summary, flags=re.M)
    # The same suite tests in the "cuda" stage (here on sim) and on sim: the same figures.
    assert re.search(r"^\d+ tests on both sim and sim$", summary, flags=re.M)
    assert "allocated sim/sim: median 1.0000, from 1.0000 to 1.0000" in summary
    assert "out of memory reported as OOM; the next test started at 0 B and passed" in summary
    assert re.search(r"^overhead per measured test: [+-][\d.]+ ms", summary, flags=re.M)

    names = sorted(p.name for p in out.iterdir())
    assert names == sorted(
        ["cuda.json", "cuda.xml", "gpu-check.log", "memory-viz.html", "sim.json",
         "snapshot.pickle", "summary.txt"]
    )  # fmt: skip
    assert all(p.is_file() and p.stat().st_size > 0 for p in out.iterdir())
    assert "torch.cuda._memory_viz" in summary
    assert "MemoryViz.js" in (out / "memory-viz.html").read_text(encoding="utf-8")
    assert snapshots.allocations(snapshots.load_snapshot(out / "snapshot.pickle"))
    assert {t["backend"] for t in json.loads((out / "cuda.json").read_text())["tests"]} == {"sim"}
    log = (out / "gpu-check.log").read_text(encoding="utf-8")
    assert "== suites-sim (limit " in log and "vram report" in log
