"""Command-line options and ini settings, read once into :class:`Settings`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from pytest_vram.backends import BACKENDS, CPU_COUNTERS, SIM_HOST_TENSORS
from pytest_vram.backends.sim.workspaces import gpu_model
from pytest_vram.units import SizeError, Tolerance, parse_size, parse_tolerance

__all__ = ["Settings", "add_options"]

#: The seed every measured test's own seed derives from unless ``--vram-seed`` says otherwise.
DEFAULT_SEED = 0

DEFAULT_TOLERANCE = "5%"

#: Which measured tests are compared, stored and held to --vram-strict: those that opted in
#: (``marked``, a vram marker or fixture), or every measured test (``all``).
GATES = ("marked", "all")
#: Under ``--vram-gate=all``, the smallest change that fails a test that did not opt in: a
#: plain unit test's few tensors change by kilobytes with every refactoring, which is noise,
#: not a memory regression anybody asked to guard.
DEFAULT_MIN_CHANGE = "1MiB"


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("vram", "GPU memory (pytest-vram)")
    group.addoption(
        "--vram-report",
        action="store_true",
        help="measure every test (on the simulated device: every test that opted in) and "
        "print a memory summary after the run; only tests that opted in are compared with "
        "baselines unless --vram-gate=all",
    )
    group.addoption(
        "--vram-gate",
        choices=GATES,
        default=None,
        help="which measured tests are compared with their baselines, stored and held to "
        "--vram-strict: marked (those with a vram marker or fixture) or all (every measured "
        "test, and every test simulated on the simulated device). Default: ini vram_gate, or "
        "marked",
    )
    group.addoption(
        "--vram-backend",
        choices=BACKENDS,
        default=None,
        help="what measures memory: cuda (the GPU), cpu (real CPU execution), sim (a simulated "
        "CUDA device), auto (cuda where available, else sim). Default: ini vram_backend, or auto",
    )
    group.addoption(
        "--vram-cpu-counter",
        choices=CPU_COUNTERS,
        default=None,
        help="how the cpu backend counts: allocator (inside PyTorch's CPU allocator, through a "
        "small library compiled on first use), dispatch (from Python, slower, sees only op "
        "outputs), auto (allocator where it builds). Default: ini vram_cpu_counter, or auto",
    )
    group.addoption(
        "--vram-sim-capacity",
        metavar="SIZE",
        default=None,
        help="total memory of the simulated device, e.g. 80GB; allocations past it raise "
        "torch.cuda.OutOfMemoryError (default: ini vram_sim_capacity, or unlimited)",
    )
    group.addoption(
        "--vram-sim-gpu",
        metavar="NAME",
        default=None,
        help="the GPU model the simulated device stands for, by torch.cuda.get_device_name(), "
        'e.g. "NVIDIA H200": its compute capability sets the cuBLAS workspace size and its '
        "memory the capacity when none is given (default: ini vram_sim_gpu, or "
        "NVIDIA H100 80GB HBM3 with unlimited capacity)",
    )
    group.addoption(
        "--vram-sim-host-tensors",
        choices=SIM_HOST_TENSORS,
        default=None,
        help="what the simulated device does with the tensors a test makes without a device: "
        "device (counts them, so code written for the CPU is measured) or host (leaves them "
        "on the host, as a GPU does: only .to('cuda') and the like put them on the device). "
        "Default: ini vram_sim_host_tensors, or device",
    )
    group.addoption(
        "--vram-sim-compute",
        choices=("auto", "never", "always"),
        default=None,
        help="when the simulated device computes values on the CPU: auto (a test runs "
        "shape-only, on fake tensors, and again computing when that fails), never, always. "
        "Default: ini vram_sim_compute, or auto",
    )
    group.addoption(
        "--vram-sim-cuda-available",
        action="store_true",
        default=None,
        help="on the simulated device, torch.cuda.is_available() answers True at collection "
        "too, so that tests skipped without a GPU run (and are measured); default: ini "
        "vram_sim_cuda_available",
    )
    group.addoption(
        "--vram-baseline-dir",
        metavar="DIR",
        default=None,
        help="where baseline files live (default: ini vram_baseline_dir, or baselines/ under "
        "the rootdir)",
    )
    group.addoption(
        "--vram-tolerance",
        metavar="TOL",
        default=None,
        help="growth over a baseline that still passes: a percentage (5%%) or a size (64MiB); "
        # argparse %-formats help texts: a literal percent sign is written %%.
        f"default: ini vram_tolerance, or {DEFAULT_TOLERANCE.replace('%', '%%')}",
    )
    group.addoption(
        "--vram-update-baselines",
        action="store_true",
        help="write the figures of the tests that ran and passed into the baseline files "
        "instead of comparing (budgets and leak checks still fail)",
    )
    group.addoption(
        "--vram-prune-baselines",
        action="store_true",
        help="remove baseline entries whose tests no longer exist",
    )
    group.addoption(
        "--vram-strict",
        action="store_true",
        default=None,
        help="fail measured tests that have no baseline entry (default: ini vram_strict)",
    )
    group.addoption(
        "--vram-seed",
        metavar="SEED",
        default=None,
        help="seed Python's, NumPy's and torch's generators before each measured test with a "
        "seed derived from SEED and the test's node id, so that reruns allocate alike; 'off' "
        f"leaves them alone (default: ini vram_seed, or {DEFAULT_SEED})",
    )
    group.addoption("--vram-json", metavar="PATH", default=None, help="write the figures as JSON")
    group.addoption(
        "--vram-markdown",
        metavar="PATH",
        default=None,
        help="write a Markdown table of the figures (also appended to $GITHUB_STEP_SUMMARY)",
    )
    group.addoption(
        "--vram-html", metavar="PATH", default=None, help="write a self-contained HTML report"
    )
    group.addoption(
        "--vram-junit-properties",
        choices=("yes", "no"),
        default=None,
        help="add vram_* properties to each measured test in --junitxml output "
        "(default: ini vram_junit_properties, or yes)",
    )
    group.addoption(
        "--vram-snapshot-on-fail",
        metavar="DIR",
        default=None,
        help="record allocations and dump a snapshot pickle in PyTorch's memory snapshot format "
        "for each failing measured test into DIR, on every backend (view it with python -m "
        "torch.cuda._memory_viz trace_plot, or at https://pytorch.org/memory_viz)",
    )
    group.addoption(
        "--vram-breakdown",
        action="store_true",
        help="break each measured test's peak down by module too, besides the category totals "
        "(parameters, gradients, optimizer, activations, temporaries, other) that sim and cpu "
        "tests store in their baselines; on cuda, take both",
    )
    group.addoption(
        "--vram-peak-lines",
        choices=("failing", "all", "no"),
        default="failing",
        help="which gated tests run once more to record the lines of your code alive at their "
        "peak: failing (over budget, a regression, a leak or out of memory; the default), "
        "all, or no",
    )
    parser.addini("vram_backend", "default backend: auto, cuda, cpu or sim", default="auto")
    parser.addini(
        "vram_cpu_counter",
        "how the cpu backend counts: auto, allocator or dispatch",
        default="auto",
    )
    parser.addini("vram_sim_capacity", "total memory of the simulated device", default="")
    parser.addini("vram_sim_gpu", "the GPU model the simulated device stands for", default="")
    parser.addini(
        "vram_sim_host_tensors",
        "the simulated device's tensors made without a device: device or host",
        default="",
    )
    parser.addini(
        "vram_sim_compute", "when the simulated device computes: auto, never, always", default=""
    )
    parser.addini(
        "vram_sim_cuda_available",
        "torch.cuda.is_available() is True at collection on the simulated device",
        type="bool",
        default=False,
    )
    parser.addini("vram_baseline_dir", "directory of the baseline files", default="baselines")
    parser.addini("vram_tolerance", "default tolerance against baselines", default="")
    parser.addini("vram_gate", "which measured tests are gated: marked or all", default="")
    parser.addini(
        "vram_min_change",
        "under vram_gate = all, the smallest change that fails a test that did not opt in "
        f"(default {DEFAULT_MIN_CHANGE})",
        default="",
    )
    parser.addini("vram_seed", "seed of each measured test, or off", default="")
    parser.addini("vram_strict", "fail tests without a baseline entry", type="bool", default=False)
    parser.addini("vram_junit_properties", "add vram_* JUnit properties", type="bool", default=True)


@dataclass(frozen=True)
class Settings:
    report: bool
    backend: str
    cpu_counter: str
    sim_capacity: int | None
    baseline_dir: Path
    tolerance: Tolerance
    update_baselines: bool
    prune_baselines: bool
    strict: bool
    json_path: Path | None
    markdown_path: Path | None
    html_path: Path | None
    junit_properties: bool
    snapshot_dir: Path | None
    #: The seed of each measured test's generators; None leaves them alone.
    seed: int | None = DEFAULT_SEED
    #: Break every measured test's peak down by category and module.
    breakdown: bool = False
    #: When the simulated device computes values: auto, never or always.
    sim_compute: str = "auto"
    #: Whether torch.cuda.is_available() answers True at collection on the simulated device.
    sim_cuda_available: bool = False
    #: The GPU model the simulated device stands for; None: the default, without a capacity.
    sim_gpu: str | None = None
    #: Where the simulated device puts tensors made without a device: device or host.
    sim_host_tensors: str = "device"
    #: Which measured tests are gated: ``marked`` (those that opted in) or ``all``.
    gate: str = "marked"
    #: Under ``gate == "all"``: the smallest change in bytes that fails a test that did not
    #: opt in.
    min_change: int = 1 << 20
    #: Whether the seed was given (option or ini): then tests that did not opt in are seeded
    #: too; otherwise they keep the random state plain pytest gives them.
    seed_given: bool = False

    @property
    def gate_all(self) -> bool:
        return self.gate == "all"

    @property
    def measure_all(self) -> bool:
        """Whether tests that did not opt in are measured too (on the simulated device, only
        where :attr:`simulate_all` says so)."""
        return self.report or self.sim_cuda_available or (self.update_baselines and self.gate_all)

    @property
    def simulate_all(self) -> bool:
        """Whether the simulated device runs tests that did not opt in: only when asked, since
        simulating a test changes how it runs, where reading a GPU's counters does not."""
        # Tests that collection let through for the simulated GPU need it to run.
        return self.sim_cuda_available or self.gate_all

    @property
    def wants_session(self) -> bool:
        """Whether the run reports or writes something even when no test is measured."""
        return (
            self.measure_all
            or self.update_baselines
            or self.prune_baselines
            or any(
                path is not None for path in (self.json_path, self.markdown_path, self.html_path)
            )
        )

    @classmethod
    def from_config(cls, config: pytest.Config) -> Settings:
        """Read and check every option; a bad value is a usage error that names the option."""
        option = config.getoption
        backend = option("--vram-backend") or config.getini("vram_backend") or "auto"
        if backend not in BACKENDS:
            raise pytest.UsageError(
                f"vram_backend = {backend!r} is not a backend: expected one of "
                f"{', '.join(BACKENDS)}"
            )
        cpu_counter = option("--vram-cpu-counter") or config.getini("vram_cpu_counter") or "auto"
        if cpu_counter not in CPU_COUNTERS:
            raise pytest.UsageError(
                f"vram_cpu_counter = {cpu_counter!r} is not a cpu counter: expected one of "
                f"{', '.join(CPU_COUNTERS)}"
            )
        capacity_text = option("--vram-sim-capacity") or config.getini("vram_sim_capacity")
        tolerance_text = (
            option("--vram-tolerance") or config.getini("vram_tolerance") or DEFAULT_TOLERANCE
        )
        try:
            capacity = parse_size(capacity_text) if capacity_text else None
        except SizeError as exc:
            raise pytest.UsageError(f"--vram-sim-capacity / vram_sim_capacity: {exc}") from None
        try:
            tolerance = parse_tolerance(tolerance_text)
        except SizeError as exc:
            raise pytest.UsageError(f"--vram-tolerance / vram_tolerance: {exc}") from None
        baseline_dir = Path(
            option("--vram-baseline-dir") or config.getini("vram_baseline_dir") or "baselines"
        )
        if not baseline_dir.is_absolute():
            base = (
                config.invocation_params.dir if option("--vram-baseline-dir") else config.rootpath
            )
            baseline_dir = base / baseline_dir
        seed_text = option("--vram-seed") or config.getini("vram_seed")
        seed = _seed(seed_text or str(DEFAULT_SEED))
        gate = option("--vram-gate") or config.getini("vram_gate") or "marked"
        if gate not in GATES:
            raise pytest.UsageError(
                f"vram_gate = {gate!r} is not a gate: expected one of {', '.join(GATES)}"
            )
        min_change_text = config.getini("vram_min_change") or DEFAULT_MIN_CHANGE
        try:
            min_change = parse_size(min_change_text)
        except SizeError as exc:
            raise pytest.UsageError(f"vram_min_change: {exc}") from None
        sim_compute = option("--vram-sim-compute") or config.getini("vram_sim_compute") or "auto"
        if sim_compute not in ("auto", "never", "always"):
            raise pytest.UsageError(
                f"vram_sim_compute = {sim_compute!r}: expected one of auto, never, always"
            )
        cuda_available = option("--vram-sim-cuda-available")
        sim_gpu = option("--vram-sim-gpu") or config.getini("vram_sim_gpu") or None
        if sim_gpu is not None:
            try:
                sim_gpu = gpu_model(sim_gpu).name
            except ValueError as exc:
                raise pytest.UsageError(f"--vram-sim-gpu / vram_sim_gpu: {exc}") from None
        host_tensors = (
            option("--vram-sim-host-tensors") or config.getini("vram_sim_host_tensors") or "device"
        )
        if host_tensors not in SIM_HOST_TENSORS:
            raise pytest.UsageError(
                f"vram_sim_host_tensors = {host_tensors!r}: expected one of "
                f"{', '.join(SIM_HOST_TENSORS)}"
            )
        strict = option("--vram-strict")
        junit = option("--vram-junit-properties")
        return cls(
            report=bool(option("--vram-report")),
            backend=backend,
            cpu_counter=cpu_counter,
            sim_capacity=capacity,
            baseline_dir=baseline_dir,
            tolerance=tolerance,
            update_baselines=bool(option("--vram-update-baselines")),
            prune_baselines=bool(option("--vram-prune-baselines")),
            strict=bool(config.getini("vram_strict") if strict is None else strict),
            json_path=_path(option("--vram-json")),
            markdown_path=_path(option("--vram-markdown")),
            html_path=_path(option("--vram-html")),
            junit_properties=(
                bool(config.getini("vram_junit_properties")) if junit is None else junit == "yes"
            ),
            snapshot_dir=_path(option("--vram-snapshot-on-fail")),
            seed=seed,
            breakdown=bool(option("--vram-breakdown")),
            sim_compute=sim_compute,
            sim_gpu=sim_gpu,
            sim_host_tensors=host_tensors,
            gate=gate,
            min_change=min_change,
            seed_given=bool(seed_text),
            sim_cuda_available=bool(
                config.getini("vram_sim_cuda_available")
                if cuda_available is None
                else cuda_available
            ),
        )


def _seed(text: str) -> int | None:
    if text.strip().lower() == "off":
        return None
    try:
        seed = int(text.strip())
    except ValueError:
        seed = -1
    if seed < 0 or not text.strip().isascii():
        raise pytest.UsageError(
            f"--vram-seed / vram_seed: {text!r} is not a seed: expected a whole number >= 0, or off"
        )
    return seed


def _path(value: str | None) -> Path | None:
    return Path(value) if value else None
