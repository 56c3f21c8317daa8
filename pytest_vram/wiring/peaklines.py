"""The peak by source line: a gated test that failed or regressed is run once more, its lines
recorded, before its teardown is reported.

The first run is the one reported: its record, its reports, what it printed. The rerun only
adds ``peak_lines`` to that record (see :mod:`pytest_vram.attribution.peaklines`), so the
JSON, JUnit and HTML reports all carry them, a pytest-xdist worker's record too (it rides on
the teardown report, made after the rerun). Tests that pass never rerun. With
``--vram-peak-lines=all`` every gated test is rerun (a workflow's second pass over the tests
a pull request flagged); with ``no``, none.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import pytest
from _pytest.runner import runtestprotocol

from pytest_vram.backends.sim.runmodes import MAY_RUN_AGAIN, run_again
from pytest_vram.record.status import Status
from pytest_vram.stash import MEASUREMENT, RECORD
from pytest_vram.wiring.itemstate import ItemState
from pytest_vram.wiring.reporthooks import add_junit_properties

if TYPE_CHECKING:
    from pytest_vram.wiring.session import VramSession

__all__ = ["PeakLines"]

#: The statuses whose lines are taken by default: the memory verdicts that fail a test.
_TAKEN = frozenset(
    s.value for s in (Status.OOM, Status.OVER_BUDGET, Status.LEAK, Status.REGRESSION)
)
_NEXT: pytest.StashKey[pytest.Item | None] = pytest.StashKey()


class PeakLines:
    """Per session: reruns the tests whose lines are wanted and adds the lines to their record."""

    def __init__(self, config: pytest.Config, session: VramSession, mode: str) -> None:
        self.config = config
        self.session = session
        self.mode = mode
        self.root = str(config.rootpath)
        self._rerunning = False
        self._recorder: Any = None
        self._lines: list[dict[str, Any]] | None = None

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None):  # type: ignore[no-untyped-def]
        # The rerun tears down as the first run did: for the same next test.
        item.stash[_NEXT] = nextitem
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
        if call.when == "teardown" and not self._rerunning:
            record = item.stash.get(RECORD, None)
            if record is not None and self._wanted(record) and not _withdrawn(item):
                self._take(item, record)
        return (yield)

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        measurement = item.stash.get(MEASUREMENT, None) if self._rerunning else None
        if measurement is None:
            return (yield)
        from pytest_vram.attribution.peaklines import PeakLineRecorder

        recorder = PeakLineRecorder(measurement.backend, self.root)
        started = recorder.start()
        try:
            return (yield)
        finally:
            if started:
                self._lines = recorder.stop()

    def _wanted(self, record: Any) -> bool:
        if self.mode == "no" or record.status in (Status.UNGATED.value, Status.SKIPPED.value):
            return False
        if record.peak_lines is not None:
            return False  # taken already
        if record.ranks is not None or self.session.ranks is not None:
            # One rank of torchrun, or simulated ranks, cannot run a test again alone: its
            # collectives (a process group's set-up among them) would wait for the others.
            return False
        if self.config.getoption("usepdb", False):
            return False  # the debugger would stop in the rerun too
        return self.mode == "all" or record.status in _TAKEN

    def _take(self, item: pytest.Item, record: Any) -> None:
        """Run ``item`` again with its lines recorded; the first run stays the one reported."""
        state = ItemState(self.session.discard, self.session.collect_again)
        properties = list(item.user_properties)
        sections = list(getattr(item, "_report_sections", []))
        # The first run's protocol goes on after this report: what it holds on the item.
        request, funcargs = getattr(item, "_request", None), getattr(item, "funcargs", None)
        kept = state.set_aside(item)
        self._rerunning, self._lines = True, None
        try:
            if request is not None:
                item._request = False  # type: ignore[attr-defined]  # a fresh one for the rerun
            # Its warnings were reported by the first run; its reports are not logged.
            with warnings.catch_warnings(record=True):
                runtestprotocol(item, nextitem=item.stash.get(_NEXT, None), log=False)
        finally:
            self._rerunning = False
            if request is not None:
                item._request = request  # type: ignore[attr-defined]
                item.funcargs = funcargs  # type: ignore[attr-defined]
            state.restore(item, kept)
            item.user_properties[:] = properties
            if isinstance(getattr(item, "_report_sections", None), list):
                item._report_sections[:] = sections  # type: ignore[attr-defined]
        if self._lines is not None:
            record.peak_lines = self._lines
            if self.session.junit_properties:
                add_junit_properties(item, record)
        self._lines = None


def _withdrawn(item: pytest.Item) -> bool:
    """Whether the run of ``item`` that just ended is one values on demand runs again (a
    shape-only attempt that wanted values, a guess that failed): its lines are not the ones
    reported."""
    tried = item.stash.get(MAY_RUN_AGAIN, None)
    if tried is None:
        return False
    if tried == "guess":
        return True
    measurement = item.stash.get(MEASUREMENT, None)
    raised = measurement.raised if measurement is not None else None
    return raised is not None and run_again(item, raised)
