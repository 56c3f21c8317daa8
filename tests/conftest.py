import pytest

# pytester's in-process runs unload the modules they imported: torch (and torch._dynamo, which
# the simulated device's fake tensors import on first use) must be imported before them, since
# their op registrations cannot be made twice in one process.
import torch
import torch._dynamo  # noqa: F401

pytest_plugins = ["pytester"]


def pytest_addoption(parser: pytest.Parser) -> None:
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
