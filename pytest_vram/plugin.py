"""The pytest plugin: options, markers, fixtures, and the wiring of the session's pieces.

Loaded in every pytest run of an environment where pytest-vram is installed, so it stays light:
the session's machinery (and torch, with a backend) is imported only once a test is measured
or an option asks for it.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from pytest_vram.backends import BackendUnavailable, create_backend
from pytest_vram.marks import MARKER_HELP
from pytest_vram.options import Settings, add_options
from pytest_vram.stash import MEASUREMENT
from pytest_vram.wiring.selection import Selection, is_xdist_controller

if TYPE_CHECKING:
    from pytest_vram.baselines.store import BaselineStore
    from pytest_vram.measure.handle import VramHandle
    from pytest_vram.measure.scenarios import LeakCheckResult, SingleStepResult

SELECTION_NAME = "vram-selection"
PLUGIN_NAME = "vram-session"
WORKER_PLUGIN_NAME = "vram-worker-reports"
CONTROLLER_PLUGIN_NAME = "vram-controller-reports"
RANKS_NAME = "vram-ranks"
VALUES_NAME = "vram-values"
FINAL_REPORTS_NAME = "vram-final-reports"
CUDA_GUARD_NAME = "vram-collection-cuda"
PEAK_LINES_NAME = "vram-peak-lines"
SETTINGS = pytest.StashKey[Settings]()


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    from pytest_vram import hookspec

    pluginmanager.add_hookspecs(hookspec)


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


@pytest.hookimpl(wrapper=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> Any:
    # --vram-sim-cuda-available (or its ini setting): the conftest files imported now see the
    # simulated device too, as collection does (backends/sim/cudaguard.py).
    if not (
        getattr(early_config.known_args_namespace, "vram_sim_cuda_available", None)
        or early_config.getini("vram_sim_cuda_available")
    ):
        return (yield)
    from pytest_vram.backends.sim.cudaguard import CollectionCuda, wanted_early

    guard = CollectionCuda()
    if wanted_early(early_config):
        guard.start()
    try:
        return (yield)
    finally:
        guard.stop()


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKER_HELP.values():
        config.addinivalue_line("markers", line)
    settings = config.stash[SETTINGS] = Settings.from_config(config)
    if settings.backend == "cuda":
        try:
            create_backend("cuda").close()
        except BackendUnavailable as exc:
            raise pytest.UsageError(f"--vram-backend=cuda: {exc}") from None
    if not hasattr(config, "workerinput"):  # only the controller writes
        junit_path = config.getoption("xmlpath", None)
        if settings.wants_session or junit_path or settings.snapshot_dir is not None:
            from pytest_vram.wiring.preflight import clashes, preflight

            problems = clashes(settings, junit_path, xdist=is_xdist_controller(config))
            if problems:
                raise pytest.UsageError("\n".join(problems))
            if settings.wants_session:
                preflight(settings)
    # A malformed baseline file stops the run before any test; a project without baseline
    # files loads nothing (nor the YAML library).
    store = _load_store(settings) if _has_baseline_files(settings) else None

    def start_session() -> None:
        from pytest_vram.backends.sim.ondemand import ValuesOnDemand
        from pytest_vram.wiring.itemstate import ItemState
        from pytest_vram.wiring.reporthooks import ControllerReports, FinalReports, WorkerReports
        from pytest_vram.wiring.session import VramSession

        if config.pluginmanager.get_plugin(PLUGIN_NAME) is not None:
            return
        session = VramSession(config, settings, store or _load_store(settings), selection)
        config.pluginmanager.register(session, PLUGIN_NAME)
        config.pluginmanager.register(FinalReports(), FINAL_REPORTS_NAME)
        peak_lines = config.getoption("--vram-peak-lines", "failing")
        if peak_lines != "no":
            from pytest_vram.wiring.peaklines import PeakLines

            config.pluginmanager.register(PeakLines(config, session, peak_lines), PEAK_LINES_NAME)
        values = ValuesOnDemand(
            config,
            policy=settings.sim_compute,
            backend=settings.backend,
            tests=ItemState(session.discard, session.collect_again),
            xdist_controller=is_xdist_controller(config),
        )
        config.pluginmanager.register(values, VALUES_NAME)
        if session.is_worker:
            worker = WorkerReports(session.environments, notes=session.notes_to_send)
            config.pluginmanager.register(worker, WORKER_PLUGIN_NAME)
        elif is_xdist_controller(config):
            controller = ControllerReports(
                session.records, session.environments, session.notes, discard=session.discard
            )
            config.pluginmanager.register(controller, CONTROLLER_PLUGIN_NAME)
        if config.pluginmanager.hasplugin("benchmark"):  # pytest-benchmark is active
            from pytest_vram.wiring import benchmarking

            benchmarking.register(config)

    if "WORLD_SIZE" in os.environ:  # launched by torchrun or another launcher
        from pytest_vram.distributed import RankPlugin, Ranks

        ranks = Ranks.from_environ()
        if ranks is not None:  # under torchrun: rank 0 alone writes the JUnit file
            config.pluginmanager.register(RankPlugin(ranks), RANKS_NAME)

    if settings.sim_cuda_available and settings.backend in ("auto", "sim"):
        from pytest_vram.backends.sim.cudaguard import CollectionCuda

        config.pluginmanager.register(CollectionCuda(), CUDA_GUARD_NAME)
    selection = Selection(config, settings, on_measured=start_session)
    config.pluginmanager.register(selection, SELECTION_NAME)
    # Runs that report or write baselines need the session whatever is measured; so does a
    # pytest-xdist controller, which collects nothing but gathers its workers' records.
    if settings.wants_session or is_xdist_controller(config):
        start_session()


def _has_baseline_files(settings: Settings) -> bool:
    directory = settings.baseline_dir
    return directory.is_dir() and any(directory.glob("*.yaml"))


def _load_store(settings: Settings) -> BaselineStore:
    from pytest_vram.baselines.errors import BaselineFileError
    from pytest_vram.baselines.store import BaselineStore

    try:
        return BaselineStore.load(settings.baseline_dir)
    except BaselineFileError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    settings = config.stash.get(SETTINGS, None)
    session = config.pluginmanager.get_plugin(PLUGIN_NAME)
    if settings is None or session is None:  # nothing measured yet: say nothing
        return None
    lines = [session.header_line()]
    if settings.seed is not None and settings.measure_all:
        which = "measured test" if settings.seed_given else "test that opted in"
        lines.append(
            f"vram: each {which} starts from its own seed, derived from {settings.seed} "
            "(--vram-seed)"
        )
    return lines


def pytest_unconfigure(config: pytest.Config) -> None:
    for name in (
        VALUES_NAME,
        FINAL_REPORTS_NAME,
        PLUGIN_NAME,
        WORKER_PLUGIN_NAME,
        CONTROLLER_PLUGIN_NAME,
        SELECTION_NAME,
        RANKS_NAME,
        CUDA_GUARD_NAME,
        PEAK_LINES_NAME,
    ):
        plugin = config.pluginmanager.get_plugin(name)
        if plugin is not None:
            if hasattr(plugin, "close"):
                plugin.close()
            config.pluginmanager.unregister(plugin)


@pytest.fixture
def vram(request: pytest.FixtureRequest) -> VramHandle:
    """Memory measurement for the current test: ``vram.device``, ``vram.measure()``,
    ``vram.empty_cache()``, ``vram.single_step(fn)``, ``vram.leak_check(fn)``."""
    from pytest_vram.measure.handle import VramHandle

    measurement = request.node.stash.get(MEASUREMENT, None)
    if measurement is None:
        pytest.fail(
            f"{request.node.nodeid}: the vram fixture was requested while the test is not "
            "measured (request.getfixturevalue?); list vram among the test's arguments",
            pytrace=False,
        )
    return VramHandle(measurement)


@pytest.fixture
def vram_empty_cache(vram: VramHandle) -> Callable[[], int]:
    """Collect garbage, release cached blocks, return the bytes still allocated."""
    return vram.empty_cache


@pytest.fixture
def vram_single_step(vram: VramHandle) -> Callable[[Callable[[], Any]], SingleStepResult]:
    """Reset the peak, run ``fn()`` once, return ``.peak``, ``.delta``, ``.before``, ``.after``."""
    return vram.single_step


@pytest.fixture
def vram_leak_check(vram: VramHandle) -> Callable[..., LeakCheckResult]:
    """``vram_leak_check(fn, steps=100, warmup=3, tolerance=None)``: fail on a leak."""
    return vram.leak_check
