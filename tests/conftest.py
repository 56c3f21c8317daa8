from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import pytest

# pytester's in-process runs unload the modules they imported: torch (and torch._dynamo, which
# the simulated device's fake tensors import on first use) must be imported before them, since
# their op registrations cannot be made twice in one process.
import torch
import torch._dynamo  # noqa: F401

pytest_plugins = ["pytester"]


def pytest_addoption(parser: pytest.Parser) -> None:
    # suites/conftest.py has the same option; a run of both folders registers it once.
    with contextlib.suppress(ValueError):
        parser.addoption(
            "--run-slow", action="store_true", help="also run the tests marked slow (CI does)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _pytester_without_randomly(request: pytest.FixtureRequest) -> None:
    # pytest-randomly, installed with the test extras, would shuffle and reseed the tests of
    # every pytester run, whose outcomes often depend on their order (values on demand guesses
    # from the file before). A run that tests pytest-randomly asks for it: -p randomly.
    if "pytester" in request.fixturenames:
        request.getfixturevalue("pytester")  # it clears PYTEST_ADDOPTS when made
        request.getfixturevalue("monkeypatch").setenv("PYTEST_ADDOPTS", "-p no:randomly")


@pytest.fixture
def every_test_simulated(_pytester_without_randomly: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pytester runs simulate every test, whether it opted in or not, as under
    --vram-gate=all (an ini override: a run without the plugin only warns of it). For the
    tests of what becomes of any test the simulated device runs."""
    options = os.environ.get("PYTEST_ADDOPTS", "")
    monkeypatch.setenv("PYTEST_ADDOPTS", f"{options} -o vram_gate=all".strip())


@pytest.fixture(scope="session", autouse=True)
def _one_counter_cache() -> Iterator[None]:
    # pytester points HOME at each test's own directory, so every pytest it starts in a
    # subprocess (and every xdist worker) would compile the cpu counter into a new cache, which
    # takes seconds. They share this session's cache instead; tests of the cache set their own.
    if os.environ.get("PYTEST_VRAM_CACHE_DIR"):
        yield
        return
    from pytest_vram.backends.cpu import build as cpu_build

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTEST_VRAM_CACHE_DIR", str(cpu_build.cache_dir()))
        yield
