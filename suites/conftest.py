"""Shared pieces of the reference suites: the GPT's import path, and ``--run-slow``."""

import contextlib
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_addoption(parser: pytest.Parser) -> None:
    # tests/conftest.py has the same option; a run of both folders registers it once.
    with contextlib.suppress(ValueError):
        parser.addoption(
            "--run-slow", action="store_true", help="also run the tests marked slow (CI does)"
        )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--run-slow"):
        return
    skip = pytest.mark.skip(reason="slow: run with --run-slow")
    for item in items:
        if "slow" in item.keywords and item.path.is_relative_to(Path(__file__).parent):
            item.add_marker(skip)
