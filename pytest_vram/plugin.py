"""The pytest plugin: options, markers and fixtures. The per-test hooks live in session.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_vram.backends import BackendUnavailable, create_backend
from pytest_vram.baselines import BaselineFileError, BaselineStore
from pytest_vram.handle import VramHandle
from pytest_vram.marks import MARKER_HELP
from pytest_vram.options import Settings, add_options
from pytest_vram.scenarios import LeakCheckResult, SingleStepResult
from pytest_vram.session import MEASUREMENT, VramSession, WorkerReports
from pytest_vram.writer import preflight

PLUGIN_NAME = "vram-session"
WORKER_PLUGIN_NAME = "vram-worker-reports"


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    for line in MARKER_HELP.values():
        config.addinivalue_line("markers", line)
    settings = Settings.from_config(config)
    if settings.backend == "cuda":
        try:
            create_backend("cuda").close()
        except BackendUnavailable as exc:
            raise pytest.UsageError(f"--vram-backend=cuda: {exc}") from None
    if not hasattr(config, "workerinput"):  # only the controller writes
        preflight(settings)
    try:
        store = BaselineStore.load(settings.baseline_dir)
    except BaselineFileError as exc:
        raise pytest.UsageError(str(exc)) from None
    session = VramSession(config, settings, store)
    config.pluginmanager.register(session, PLUGIN_NAME)
    if session.is_worker:
        config.pluginmanager.register(WorkerReports(session), WORKER_PLUGIN_NAME)


def pytest_unconfigure(config: pytest.Config) -> None:
    session = config.pluginmanager.get_plugin(PLUGIN_NAME)
    if session is not None:
        session.close()
        config.pluginmanager.unregister(session)
    worker = config.pluginmanager.get_plugin(WORKER_PLUGIN_NAME)
    if worker is not None:
        config.pluginmanager.unregister(worker)


@pytest.fixture
def vram(request: pytest.FixtureRequest) -> VramHandle:
    """Memory measurement for the current test: ``vram.device``, ``vram.measure()``,
    ``vram.empty_cache()``, ``vram.single_step(fn)``, ``vram.leak_check(fn)``."""
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
