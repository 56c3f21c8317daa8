"""The backstop of values on demand: a test that fails on the simulated device for a reason
its memory does not explain is run once more as without the plugin.

A test simulated although it did not opt in (``--vram-gate=all``) keeps the outcome plain
pytest gives it when that run passes: its memory was not simulated, and the run's notes say
why. A test that opted in still fails, with a message that says it passes without the
simulated device, and why it failed there. A test that uses a vram fixture cannot run without
the plugin, and keeps its failure as it is.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Protocol

import pytest
from _pytest.runner import runtestprotocol

__all__ = ["PlainTests", "fails_only_simulated", "passed", "run_plain"]


class PlainTests(Protocol):
    """What the backstop asks the session of a measured test."""

    def opted_in(self, item: pytest.Item) -> bool:
        """Whether the test opted in (a vram marker or fixture)."""

    def runs_plain(self, item: pytest.Item) -> bool:
        """Whether the test can run without the plugin (it uses no vram fixture)."""

    def unmeasured(self, item: pytest.Item) -> AbstractContextManager[None]:
        """While entered, the session runs the test as one it does not measure."""


def run_plain(
    item: pytest.Item, nextitem: pytest.Item | None, tests: PlainTests
) -> list[pytest.TestReport]:
    """Run ``item``'s protocol as without the plugin; its reports, not logged."""
    with tests.unmeasured(item):
        return runtestprotocol(item, nextitem=nextitem, log=False)


def passed(reports: list[pytest.TestReport]) -> bool:
    return not any(report.failed for report in reports)


def fails_only_simulated(reports: list[pytest.TestReport], cause: str | None) -> None:
    """Say, in each failed report of an opted-in test, that it passes without the simulated
    device and what failed on it."""
    for report in reports:
        if report.failed:
            report.longrepr = (
                "fails on the simulated device and passes without it (pytest -p no:vram): "
                f"{cause or 'see below'}\n\n{_text(report)}"
            )


def _text(report: pytest.TestReport) -> str:
    return str(report.longrepr or "").rstrip()
