"""What the session selected: which tests opted in, which are measured, and what collection
left out.

A test opts in with a vram marker or fixture. Tests that did not are measured too under
``--vram-report`` on cuda and cpu, where measuring is reading counters; on the simulated device
they run as without the plugin unless every test is to be simulated
(:attr:`~pytest_vram.options.Settings.simulate_all`).

The stale baseline entries follow from it: an entry is stale only where this run can tell that
its test no longer exists, or no longer opts in while only tests that opt in are gated, never
because a filter (``-k``, ``-m``, ``--deselect``, ``--lf``, a plugin's ``modifyitems``, a
``file::test`` argument) left the test out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.backends import resolve_name
from pytest_vram.marks import MarkerError, VramMarks, read_marks
from pytest_vram.options import Settings
from pytest_vram.stash import MARKER_ERROR, MARKS, OPTED_IN

__all__ = ["VRAM_FIXTURES", "Selection", "is_xdist_controller"]

VRAM_FIXTURES = frozenset({"vram", "vram_empty_cache", "vram_single_step", "vram_leak_check"})


def is_xdist_controller(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist controller: it collects and runs no test, and
    gathers what its workers report."""
    return not hasattr(config, "workerinput") and config.getoption("dist", "no") != "no"


class Selection:
    """Reads each test's markers once and remembers what collection kept and left out; calls
    ``on_measured`` once collection has found a test to measure."""

    def __init__(
        self, config: pytest.Config, settings: Settings, on_measured: Callable[[], Any]
    ) -> None:
        self.config = config
        self.settings = settings
        self.measure_all = settings.measure_all
        self._on_measured = on_measured
        #: Node ids of the tests collected, before any plugin's modifyitems removed some.
        self.collected: set[str] | None = None
        #: Node ids that filters deselected: they exist.
        self.deselected: set[str] = set()
        self._deselected_items: list[pytest.Item] = []
        #: Node ids of the tests kept or deselected that did not opt in.
        self.not_opted_in: set[str] = set()
        self._default_is_sim: bool | None = None

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # tryfirst: the full collection, before -k/-m or plugins deselect, tells stale entries.
        self.collected = {item.nodeid for item in items}

    def pytest_deselected(self, items: list[pytest.Item]) -> None:
        self.deselected.update(item.nodeid for item in items)
        # Whether they opted in is read only if a stale entry needs it (see stale()).
        self._deselected_items.extend(items)

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # After every plugin's modifyitems, so that the markers they add count. Reading them
        # here, once, also keeps the parsing out of each test's setup.
        if self.mark_measured(session.items):
            self._on_measured()

    def mark_measured(self, items: Iterable[pytest.Item]) -> bool:
        """Stash the parsed markers of each test that is measured, and whether it opted in;
        whether there is one."""
        measured = False
        for item in items:
            try:
                marks, invalid = read_marks(list(item.iter_markers())), False
            except MarkerError as exc:
                item.stash[MARKER_ERROR] = exc
                marks, invalid = VramMarks(), True
            opted_in = invalid or marks.any or _uses_vram_fixture(item)
            if not opted_in:
                self.not_opted_in.add(item.nodeid)
                if not (self.measure_all and self._measures_others()):
                    continue
            item.stash[MARKS] = marks
            item.stash[OPTED_IN] = opted_in
            measured = True
        return measured

    def _measures_others(self) -> bool:
        """Whether this run measures the tests that did not opt in (``measure_all`` given): on
        the simulated device only when every test is to be simulated."""
        if self.settings.simulate_all:
            return True
        if self._default_is_sim is None:
            try:
                self._default_is_sim = resolve_name(self.settings.backend) == "sim"
            except ImportError:  # no torch here: nothing to measure a plain test with
                self._default_is_sim = True
        return not self._default_is_sim

    def no_longer_opted_in(self, nodeids: Iterable[str]) -> list[str]:
        """Those of ``nodeids`` whose tests exist and no longer opt in, while only tests that
        opt in are gated: their entries are never compared again."""
        if self.collected is None or self.settings.gate_all:
            return []
        if self._deselected_items:
            for item in self._deselected_items:
                try:
                    opted_in = read_marks(list(item.iter_markers())).any
                except MarkerError:
                    opted_in = True
                if not (opted_in or _uses_vram_fixture(item)):
                    self.not_opted_in.add(item.nodeid)
            self._deselected_items = []
        return sorted(nodeid for nodeid in nodeids if nodeid in self.not_opted_in)

    def stale(self, nodeids: Iterable[str]) -> list[str]:
        """Those of ``nodeids`` whose tests no longer exist (their file is gone, or this run
        collected the whole file without finding them) or no longer opt in while only tests
        that opt in are gated."""
        if self.collected is None:  # a pytest-xdist controller sees no collection
            return []
        nodeids = set(nodeids)
        if not nodeids:  # no baseline entries: nothing to look up the collection for
            return []
        stale = set(self.no_longer_opted_in(nodeids))
        root = self.config.rootpath
        known = self.collected | self.deselected
        collected_files = {nodeid.split("::")[0] for nodeid in self.collected}
        partial = self._partial_files()
        for nodeid in nodeids:
            if nodeid in known:
                continue
            path = nodeid.split("::")[0]
            if not (root / path).exists() or (
                path in collected_files
                and partial is not None
                and (root / path).resolve() not in partial
            ):
                stale.add(nodeid)
        return sorted(stale)

    def _partial_files(self) -> set[Path] | None:
        """Files this run collected only in part; None when that may be any file (--lf
        collects only the failures of each file it reruns)."""
        if self.config.getoption("lf", False):
            return None
        invocation = self.config.invocation_params.dir
        return {
            (invocation / arg.split("::")[0]).resolve() for arg in self.config.args if "::" in arg
        }


def _uses_vram_fixture(item: pytest.Item) -> bool:
    return not VRAM_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
