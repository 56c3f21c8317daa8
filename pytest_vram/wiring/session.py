"""The per-test protocol: start a measurement before setup, judge it after the call, finish it
after teardown, and hand the record to whoever writes the reports.

Data flows one way: backend -> measurement -> record -> verdict -> the session's records ->
baselines and reports. Under pytest-xdist the record travels from the worker to the controller
as plain data on the teardown report, and only the controller writes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from pytest_vram.attribution.recorder import Attribution
from pytest_vram.backends import Backend
from pytest_vram.backends.sim.ondemand import HELD_BACK
from pytest_vram.backends.sim.runmodes import MAY_RUN_AGAIN, RunAgain, run_again
from pytest_vram.backends.sim.valuesoff import needs_values_message
from pytest_vram.baselines.store import BaselineStore
from pytest_vram.distributed import RankExchange, entry_for_rank
from pytest_vram.garbage import OLD_GARBAGE, collect_garbage
from pytest_vram.marks import VramMarks
from pytest_vram.measure.measurement import TestMeasurement
from pytest_vram.measure.ownership import OwnView, broader_scoped, still_held_by_fixtures, view_for
from pytest_vram.measure.scenarios import LeakError
from pytest_vram.options import Settings
from pytest_vram.raised import is_out_of_memory, release_exception
from pytest_vram.record.record import TestRecord
from pytest_vram.stash import (
    IN_CALL,
    MARKS,
    MEASUREMENT,
    OPTED_IN,
    RECORD,
    REPORTED_FAILED,
    SUBTEST_ERRORS,
)
from pytest_vram.verdict import Outcome, Status, Verdict, judge
from pytest_vram.wiring.fixturehooks import BROADER_FIXTURES_NAME, BroaderFixtures
from pytest_vram.wiring.header import header_line
from pytest_vram.wiring.pool import BackendPool
from pytest_vram.wiring.reporthooks import (
    add_junit_properties,
    failed_instead,
    first_line_of,
    warn_at_test,
    with_late_sections,
)
from pytest_vram.wiring.runend import RunEnd
from pytest_vram.wiring.seeding import Seeder, pause_randomly
from pytest_vram.wiring.selection import Selection
from pytest_vram.wiring.snapshots import SnapshotError, SnapshotRecorder
from pytest_vram.wiring.testbackend import backend_for

__all__ = ["VramSession"]


class VramSession:
    """The plugin's state for one pytest session (one per xdist worker, and the controller)."""

    def __init__(
        self,
        config: pytest.Config,
        settings: Settings,
        store: BaselineStore,
        selection: Selection,
    ) -> None:
        self.config = config
        self.settings = settings
        self.store = store
        self.is_worker = hasattr(config, "workerinput")
        #: Under torchrun: how records reach rank 0, the one rank that reports.
        self.ranks = RankExchange.from_environ()
        self.reports = not self.is_worker and (self.ranks is None or self.ranks.reports)
        # The properties go to --junitxml (on xdist workers too: they share the options).
        self.junit_properties = settings.junit_properties and bool(
            config.getoption("xmlpath", None)
        )
        self.selection = selection
        self.pool = BackendPool(settings, config.hook)
        self.records: list[TestRecord] = []
        self.environments: dict[str, dict[str, Any]] = self.pool.environments
        self.notes: list[str] = []
        #: The node ids of the tests that ran, measured or not: those without a record ran
        #: unmeasured.
        self.ran: set[str] = set()
        self.snapshots = SnapshotRecorder(settings.snapshot_dir)
        self.attribution = Attribution(getattr(settings, "breakdown", False))
        #: The raw allocation each backend had when its last measured test ended.
        self._last_end: dict[str, int] = {}
        self.seeder = Seeder(settings.seed) if settings.seed is not None else None
        #: While a measured test runs: what resumes pytest-randomly's reseeding.
        self._resume_randomly: Any = None
        #: The measurement of the test being set up or run, None between tests.
        self._current: TestMeasurement | None = None
        #: What :func:`broader_scoped` has worked out, for the tests that share it.
        self._broader: dict[int, Any] = {}
        #: Registered once a measured test has broader-scoped fixtures: most suites' fixture
        #: setups then pay nothing for this plugin.
        self._fixtures: BroaderFixtures | None = None
        #: Per backend, the view of the tests without broader-scoped fixtures. One for all of
        #: them: items live as long as the session, and with them what their measurements
        #: hold, which every garbage collection of the run walks again.
        self._plain_views: dict[str, OwnView] = {}
        #: What the run's end does with the records, in the process that reports.
        self.end = RunEnd(
            config,
            settings,
            store,
            selection,
            records=self.records,
            environments=self.environments,
            notes=self.notes,
            junit_properties=self.junit_properties,
            ran=self.ran,
        )

    def close(self) -> None:
        self.attribution.close()
        if self.seeder is not None:
            self.seeder.close()
        if self._fixtures is not None:
            self.config.pluginmanager.unregister(self._fixtures)
            self._fixtures = None
        self.pool.close()

    def header_line(self) -> str:
        """The session header's line: which backend measures, and which baseline file."""
        return header_line(self.config, self.settings, self.store, self.pool)

    # -- the run --------------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True)
    def pytest_runtestloop(self, session: pytest.Session):  # type: ignore[no-untyped-def]
        # A test that leaves memory allocated gets a full garbage collection, to tell a leak
        # from a reference cycle. What exists now is frozen, left out of it (not collected
        # first: that alone would cost a small suite a tenth of its time; what is garbage now
        # is freed after the run).
        OLD_GARBAGE.watch()
        try:
            return (yield)
        finally:
            OLD_GARBAGE.unwatch()

    # -- the test's phases ----------------------------------------------------------------

    # trylast: the innermost wrapper, so the measurement starts right before fixtures are set
    # up. What setup raised is read from pytest's report of it (pytest_runtest_makereport).
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        marks = item.stash.get(MARKS, None)
        if marks is None:  # not measured: runs as without the plugin, global hooks included
            self.pool.pause_all()
            self.attribution.close()
            return (yield)
        for key in (MEASUREMENT, SUBTEST_ERRORS, REPORTED_FAILED):  # an earlier run's
            if key in item.stash:
                del item.stash[key]
        self._begin(item, marks)
        return (yield)

    def _begin(self, item: pytest.Item, marks: VramMarks) -> TestMeasurement:
        pool = self.pool
        opted_in = item.stash.get(OPTED_IN, True)
        # A test simulated only because every test is gated runs the code paths it runs plain:
        # it sees the machine's CUDA, unless the simulated device's is asked for everywhere.
        backend = backend_for(
            item,
            marks,
            pool,
            self.settings.backend,
            cuda_shown=opted_in or self.settings.sim_cuda_available,
        )
        ranks = None
        if marks.world_size is not None:  # simulated ranks on sim, the real ones under torchrun
            from pytest_vram.backends.sim.ranks import ranks_for

            ranks = ranks_for(item.nodeid, marks.world_size, backend)
        self._clean(backend)
        nodeid = item.nodeid
        # A test that did not opt in keeps the random state plain pytest gives it, unless a
        # seed was asked for.
        seeded = self.seeder is not None and (opted_in or self.settings.seed_given)
        if seeded:
            self.seeder.start(nodeid)  # type: ignore[union-attr]
        name = backend.name
        device = pool.device_classes[name]
        fixtures = broader_scoped(item, self._broader)
        if fixtures and self._fixtures is None:
            self._fixtures = BroaderFixtures(lambda: self._current)
            self.config.pluginmanager.register(self._fixtures, BROADER_FIXTURES_NAME)
        view = view_for(item, backend, fixtures) if fixtures else self._plain_view(backend)
        measurement = TestMeasurement(view, nodeid, device)  # type: ignore[arg-type]
        measurement.marks = marks
        measurement.fixtures = fixtures or ()
        measurement.ranks = ranks
        measurement.opted_in = opted_in
        measurement.gated = gated = opted_in or self.settings.gate_all
        # Looked up once: the judge and attribution read the same entry. A test that is not
        # gated has none: it is never compared.
        entry = measurement.entry = self.store.entry(device, nodeid) if gated else None
        if self.snapshots.directory is not None:
            self.snapshots.start(backend)
        measurement.begin()
        if self.attribution.wants_breakdown(entry, backend):
            measurement.attributed = self.attribution.begin(backend)
        if seeded and self._resume_randomly is None:
            self._resume_randomly = pause_randomly(self.config.option)
        item.stash[MEASUREMENT] = self._current = measurement
        return measurement

    def _plain_view(self, backend: Backend) -> OwnView:
        view = self._plain_views.get(backend.name)
        if view is None:  # the pool makes each backend once a session
            view = self._plain_views[backend.name] = OwnView(backend, 0)
        return view

    def _clean(self, backend: Backend) -> None:
        """Collect what earlier tests left and empty the allocator cache, so that this test
        starts from the same state whatever ran before it."""
        floor = self._last_end.get(backend.name, 0)
        if backend.allocated() > floor:
            collect_garbage(backend, floor)
        backend.release_cache()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        measurement = item.stash.get(MEASUREMENT, None)
        if measurement is None:
            return (yield)
        item.stash[IN_CALL] = True
        try:
            return (yield)
        finally:
            del item.stash[IN_CALL]
            measurement.finish_call()
            if measurement.attributed:
                self.attribution.finish_call(measurement.record)

    # How a test ended is read from pytest's own report of it, not from what passes through
    # this plugin's wrappers: unittest's TestCase and subtests store their failures instead of
    # raising them, and so may any runner. trylast: the innermost wrapper, after unittest's
    # support has put the stored failure on the call, and before pytest's xfail handling sees
    # the memory verdict's failure, as it would see the test's own.
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_makereport(  # type: ignore[no-untyped-def]
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ):
        report = yield
        measurement = item.stash.get(MEASUREMENT, None)
        if measurement is None or call.when == "teardown":
            return report
        if call.when == "setup":
            if call.excinfo is not None:  # a failure, or a skip (a marker's or a fixture's)
                exc = measurement.raised = call.excinfo.value
                skipped = isinstance(exc, pytest.skip.Exception)
                measurement.verdict = Verdict(Status.SKIPPED if skipped else Status.FAILED)
            return report
        if item.stash.get(IN_CALL, False):
            return self._subtest_report(item, measurement, call, report)
        return self._call_report(item, measurement, call, report)

    def _call_report(
        self,
        item: pytest.Item,
        measurement: TestMeasurement,
        call: pytest.CallInfo[None],
        report: pytest.TestReport,
    ) -> pytest.TestReport:
        if call.excinfo is not None:
            exc = measurement.raised = call.excinfo.value
            explanation = self._on_error(item, measurement, exc)
            if explanation is not None:
                return failed_instead(item, call, explanation)
            return with_late_sections(item, report)
        if SUBTEST_ERRORS in item.stash:
            measurement.verdict = self._judge(measurement, Outcome.FAILED)
            return report
        verdict = measurement.verdict = self._judge(measurement, Outcome.PASSED)
        if verdict.warnings:
            verdict = measurement.verdict = warn_at_test(item, verdict)
        if verdict.status.fails:
            self._dump_snapshot(item, self.pool.backends[measurement.record.backend])
            return failed_instead(item, call, "\n".join(verdict.failures))
        return report

    def _subtest_report(
        self,
        item: pytest.Item,
        measurement: TestMeasurement,
        call: pytest.CallInfo[None],
        report: pytest.TestReport,
    ) -> pytest.TestReport:
        may_run_again = item.stash.get(MAY_RUN_AGAIN, None) is not None
        if report.failed:
            assert call.excinfo is not None
            exc = call.excinfo.value
            item.stash.setdefault(SUBTEST_ERRORS, []).append(exc)
            if run_again(item, exc):
                # The run ends here, its reports withdrawn; the next one reports this subtest.
                raise RunAgain(first_line_of(exc)) from exc
            explanation = self._explain(item, exc)
            if explanation is not None:
                report = failed_instead(item, call, explanation)
        if may_run_again:
            setattr(report, HELD_BACK, True)  # shown only if this run stands
        return report

    def _explain(self, item: pytest.Item, exc: BaseException) -> str | None:
        """The short error that stands for ``exc`` in the test's report; None to keep it."""
        measurement = item.stash[MEASUREMENT]
        backend = self.pool.backends[measurement.record.backend]
        if not backend.computing:
            message = needs_values_message(exc, item.config.rootpath)
            if message is not None:
                return message
        return backend.explain_error(exc)

    def _judge(
        self,
        measurement: TestMeasurement,
        outcome: Outcome,
        error: str | None = None,
    ) -> Verdict:
        record = measurement.record
        marks = measurement.marks
        assert marks is not None  # set when the measurement began
        # Read for a budget the backend cannot check, to say why.
        unmeasured = self.pool.backends[record.backend].unmeasured if marks.budgets else None
        entry = measurement.entry
        if self.ranks is not None:  # each rank against its own figures
            entry = entry_for_rank(entry, self.ranks.ranks.rank)
        return judge(
            record,
            marks,
            entry,
            self.settings,
            outcome,
            error=error,
            unmeasured=unmeasured or None,
            gated=measurement.gated,
            floor=0 if measurement.opted_in else self.settings.min_change,
        )

    def _on_error(
        self, item: pytest.Item, measurement: TestMeasurement, exc: BaseException
    ) -> str | None:
        """Judge a test whose call raised ``exc``; the short error to report instead of it,
        if there is one."""
        backend = self.pool.backends[measurement.record.backend]
        if isinstance(exc, pytest.skip.Exception):
            measurement.verdict = Verdict(Status.SKIPPED)
            return None
        if is_out_of_memory(exc):
            outcome = Outcome.OUT_OF_MEMORY
            summary = backend.memory_summary()
            if summary:
                item.add_report_section("call", "vram allocator state", summary)
        elif isinstance(exc, LeakError):
            outcome = Outcome.LEAKED
        else:
            outcome = Outcome.FAILED
        error = str(exc).strip().splitlines()[0] if str(exc).strip() else None
        measurement.verdict = self._judge(measurement, outcome, error)
        self._dump_snapshot(item, backend)
        if isinstance(exc, RunAgain):
            return None  # withdrawn with its run
        return self._explain(item, exc)

    def _dump_snapshot(self, item: pytest.Item, backend: Backend) -> None:
        try:
            path = self.snapshots.dump(backend, item.nodeid)
        except SnapshotError as exc:  # a note: the test's own failure stays the one reported
            item.add_report_section("call", "vram snapshot", str(exc))
            self.notes.append(str(exc))  # now: an xdist worker's notes ride on its teardown
            return
        if path is not None:
            item.stash[MEASUREMENT].record.snapshot = str(path)
            item.add_report_section("call", "vram snapshot", f"allocator snapshot: {path}")

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        try:
            return (yield)
        finally:
            measurement = item.stash.get(MEASUREMENT, None)
            if measurement is not None:
                self._finish(item, measurement)

    def _finish(self, item: pytest.Item, measurement: TestMeasurement) -> None:
        self._current = None
        resume, self._resume_randomly = self._resume_randomly, None
        if resume is not None:
            resume()
        if measurement.ranks is not None:
            measurement.ranks.stop()
        if measurement.attributed:
            self.attribution.end()
        if self.snapshots.directory is not None:
            self.snapshots.stop()
        # The call never ran under --setup-only and --setup-plan.
        verdict = measurement.verdict or Verdict(Status.SKIPPED)
        raised = measurement.raised
        if raised is not None:
            release_exception(raised)
            OLD_GARBAGE.let_go()
        if SUBTEST_ERRORS in item.stash:
            for error in item.stash[SUBTEST_ERRORS]:
                release_exception(error)
            OLD_GARBAGE.let_go()
            # Whether any failed is what a pytest-xdist worker's record says now.
            item.stash[SUBTEST_ERRORS] = []
        # pytest drops the test's fixture values only after the teardown report; drop them now,
        # or what the test's function-scoped fixtures held would count as left over.
        funcargs = getattr(item, "funcargs", None)
        if isinstance(funcargs, dict):
            funcargs.clear()
        measurement.end()
        record = measurement.record
        backend = self.pool.backends[record.backend]
        # What the test's broader-scoped fixtures still hold is theirs, not left over by the
        # test: the end counts them as they were at the start, whichever test made them.
        if measurement.fixtures:
            held = still_held_by_fixtures(item, backend, measurement.fixtures)
            record.end_allocated += record.start_allocated - held
        else:
            record.end_allocated += record.start_allocated
        self._last_end[record.backend] = backend.allocated()
        if item.stash.get(REPORTED_FAILED, False) and not verdict.status.fails:
            # Failed as pytest reports it, though nothing raised: a strict XPASS.
            verdict = dataclasses.replace(verdict, status=Status.FAILED)
        status = verdict.status
        record.status = status._value_
        if status is Status.SKIPPED:
            record.outcome = "skipped"
        else:
            record.outcome = "failed" if raised is not None or status.fails else "passed"
        if verdict.failures or verdict.notes:
            record.messages = verdict.failures + verdict.notes
        record.budgets = verdict.budgets
        record.baseline = verdict.baseline
        if self.ranks is not None:
            record = self.ranks.exchange(record, measurement.entry)
        if self.junit_properties:
            add_junit_properties(item, record)
        earlier_record = item.stash.get(RECORD, None)
        if earlier_record is not None and not self.is_worker:
            self.discard(earlier_record)  # the test ran again: its last run is reported
        # For WorkerReports, on the teardown report, and for a rerun to discard it.
        item.stash[RECORD] = record
        if raised is None:
            # Kept only for what the test raised, which values on demand reads after the
            # reports. Items live as long as the session, and every garbage collection of
            # the run would walk what they hold.
            del item.stash[MEASUREMENT]
        if not self.is_worker:
            # Its backend's environment is the pool's, in self.environments since it was made.
            self.records.append(record)

    # -- the controller: collect records, write reports -----------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when == "setup" and self.reports:
            self.ran.add(report.nodeid)

    def discard(self, record: TestRecord) -> None:
        """Forget a record collected for a run of a test that is run again."""
        self.records[:] = [kept for kept in self.records if kept is not record]

    def collect_again(self, record: TestRecord) -> None:
        """Collect the record of a run set aside that stands after all."""
        if not self.is_worker:
            self.records.append(record)

    def notes_to_send(self) -> list[str]:
        """What a pytest-xdist worker has to say so far, for its controller to tell."""
        return [*self.notes, *self.pool.notes]

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.pool.pause_all()
        self.notes[:0] = [note for note in self.pool.notes if note not in self.notes]
        if self.ranks is not None:
            self.ranks.close()
            self.notes += self.ranks.notes
        if not self.reports:
            return
        self.end.finish(session)
        self.notes += self.snapshots.notes()

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.reports:
            self.end.summary(terminalreporter)
