"""The per-test protocol: start a measurement before setup, judge it after the call, finish it
after teardown, and hand the record to whoever writes the reports.

Data flows one way: backend -> measurement -> record -> verdict -> the session's records ->
baselines and reports. Under pytest-xdist the record travels from the worker to the controller
as plain data on the teardown report, and only the controller writes.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from pathlib import Path
from typing import Any

import pytest

from pytest_vram.attribution.recorder import Attribution
from pytest_vram.backends import Backend, BackendUnavailable
from pytest_vram.backends.sim.values import (
    COMPUTE,
    GUESS,
    HELD,
    REASON,
    TRIED,
    RunAgain,
    needs_values_message,
    run_again,
)
from pytest_vram.baselines import BaselineStore
from pytest_vram.distributed import RankExchange, entry_for_rank
from pytest_vram.errors import VramWarning
from pytest_vram.frames import is_out_of_memory, release_exception
from pytest_vram.marks import MarkerError, VramMarks
from pytest_vram.measurement import OLD_GARBAGE, TestMeasurement, collect_garbage
from pytest_vram.options import Settings
from pytest_vram.ownership import OwnView, broader_scoped, still_held_by_fixtures, view_for
from pytest_vram.pool import BackendPool
from pytest_vram.records import TestRecord
from pytest_vram.report import (
    build_document,
    junit_properties,
    suite_properties,
    terminal_lines,
)
from pytest_vram.scenarios import LeakError
from pytest_vram.seeding import Seeder, pause_randomly
from pytest_vram.selection import (
    MARKER_ERROR,
    MARKS,
    MEASUREMENT,
    Selection,
    is_xdist_controller,
)
from pytest_vram.snapshots import SnapshotError, SnapshotRecorder
from pytest_vram.units import describe_size, format_size
from pytest_vram.verdict import Outcome, Status, Verdict, judge
from pytest_vram.writer import BaselineWriter, fail_on_errors, write_outputs

__all__ = ["MEASUREMENT", "FinalReports", "VramSession", "WorkerReports"]

#: Set on a measured test after its teardown: its finished record.
RECORD = pytest.StashKey[TestRecord]()
#: Set on a measured test while its call runs: a report made then is a subtest's.
IN_CALL = pytest.StashKey[bool]()
#: Set on a measured test one of whose subtests failed in this run: what they raised.
SUBTEST_ERRORS = pytest.StashKey[list[BaseException]]()
#: Set on a measured test whose setup or call pytest reported failed (a strict XPASS too).
REPORTED_FAILED = pytest.StashKey[bool]()
#: The JUnit properties the last run of a test added: a rerun's replace them.
PROPERTIES = pytest.StashKey[list[tuple[str, object]]]()
BROADER_FIXTURES_NAME = "vram-broader-fixtures"


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
        #: On a pytest-xdist controller: the record collected for each test.
        self._collected: dict[str, TestRecord] = {}

    def close(self) -> None:
        if self.seeder is not None:
            self.seeder.close()
        if self._fixtures is not None:
            self.config.pluginmanager.unregister(self._fixtures)
            self._fixtures = None
        self.pool.close()

    def header_line(self) -> str:
        """The session header's line: which backend measures, and which baseline file."""
        from pytest_vram.backends import resolve_name
        from pytest_vram.baselines import file_name_for

        asked = self.settings.backend
        if not self.is_worker and is_xdist_controller(self.config):
            # The controller measures nothing: its workers make the backend.
            return f"vram: backend {resolve_name(asked)} (--vram-backend={asked}), in each worker"
        try:
            backend = self.pool.get(asked)
        except BackendUnavailable as exc:
            return f"vram: backend {asked}: not available here ({exc})"
        device = self.pool.device_classes[backend.name]
        path = self.settings.baseline_dir / file_name_for(device)
        stored = self.store.get(device)
        entries = len(stored.entries) if stored is not None else 0
        return (
            f"vram: backend {backend.name} (--vram-backend={asked}), device class {device!r}, "
            f"baselines {_shown_path(path)} ({entries} {'entry' if entries == 1 else 'entries'})"
        )

    @property
    def current(self) -> TestMeasurement | None:
        """The measurement of the test being set up or run, None between tests."""
        return self._current

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
        if marks is None:  # not measured
            self.pool.pause_all()
            return (yield)
        for key in (MEASUREMENT, SUBTEST_ERRORS, REPORTED_FAILED):  # an earlier run's
            if key in item.stash:
                del item.stash[key]
        self._begin(item, marks)
        return (yield)

    def _begin(self, item: pytest.Item, marks: VramMarks) -> TestMeasurement:
        pool = self.pool
        try:
            if MARKER_ERROR in item.stash:
                raise item.stash[MARKER_ERROR]
            backend = pool.get(marks.backend or self.settings.backend)
        except (MarkerError, BackendUnavailable) as exc:
            problem = f"usage error in {item.nodeid}: {exc}"
        else:
            problem = None
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        if len(pool.backends) > 1:  # the only one is this test's: nothing else to pause
            pool.pause_all(keep=backend)
        use_values = getattr(backend, "use_values", None)
        if use_values is not None:  # the simulated device: shape-only, or computing
            stash = item.stash
            use_values(
                stash.get(COMPUTE, False), stash.get(REASON, None), guess=stash.get(GUESS, False)
            )
        if marks.required is not None:
            total = backend.total_memory()
            if total is not None and total < marks.required:
                raise pytest.skip.Exception(
                    f"requires_vram({describe_size(marks.required_as_written)}): the "
                    f"{backend.name} device has {format_size(total)}",
                    _use_item_location=True,  # reported at the test, as a marker's skip is
                )
        ranks = None
        if marks.world_size is not None:  # simulated ranks on sim, the real ones under torchrun
            from pytest_vram.backends.sim.ranks import ranks_for

            ranks = ranks_for(item.nodeid, marks.world_size, backend)
        self._clean(backend)
        nodeid = item.nodeid
        if self.seeder is not None:
            self.seeder.start(nodeid)
        name = backend.name
        device = pool.device_classes[name]
        fixtures = broader_scoped(item, self._broader)
        if fixtures and self._fixtures is None:
            self._fixtures = BroaderFixtures(self)
            self.config.pluginmanager.register(self._fixtures, BROADER_FIXTURES_NAME)
        view = view_for(item, backend, fixtures) if fixtures else self._plain_view(backend)
        measurement = TestMeasurement(view, nodeid, device)  # type: ignore[arg-type]
        measurement.marks = marks
        if fixtures:
            measurement.fixtures = fixtures
        if ranks is not None:
            measurement.ranks = ranks
        # Looked up once: the judge and attribution read the same entry.
        entry = self.store.entry(device, nodeid)
        if entry is not None:
            measurement.entry = entry
        if self.snapshots.directory is not None:
            self.snapshots.start(backend)
        measurement.begin()
        if self.attribution.wants_breakdown(entry):
            measurement.attributed = self.attribution.begin(backend)
        if self.seeder is not None and self._resume_randomly is None:
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
                return _failed_instead(item, call, explanation)
            return _with_late_sections(item, report)
        if SUBTEST_ERRORS in item.stash:
            measurement.verdict = self._judge(measurement, Outcome.FAILED)
            return report
        verdict = measurement.verdict = self._judge(measurement, Outcome.PASSED)
        if verdict.warnings:
            verdict = measurement.verdict = _warn(item, verdict)
        if verdict.status.fails:
            self._dump_snapshot(item, self.pool.backends[measurement.record.backend])
            return _failed_instead(item, call, "\n".join(verdict.failures))
        return report

    def _subtest_report(
        self,
        item: pytest.Item,
        measurement: TestMeasurement,
        call: pytest.CallInfo[None],
        report: pytest.TestReport,
    ) -> pytest.TestReport:
        if not report.failed:
            if item.stash.get(TRIED, None) is not None:
                setattr(report, HELD, True)  # shown only if this run stands
            return report
        assert call.excinfo is not None
        exc = call.excinfo.value
        item.stash.setdefault(SUBTEST_ERRORS, []).append(exc)
        if run_again(item, exc):
            # The run ends here, its reports withdrawn; the next one reports this subtest.
            raise RunAgain(_first_line_of(exc)) from exc
        explanation = self._explain(item, exc)
        if explanation is not None:
            return _failed_instead(item, call, explanation)
        return report

    def _explain(self, item: pytest.Item, exc: BaseException) -> str | None:
        """The short error that stands for ``exc`` in the test's report; None to keep it."""
        measurement = item.stash[MEASUREMENT]
        backend = self.pool.backends[measurement.record.backend]
        if backend.name == "sim" and not getattr(backend, "computing", False):
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
        if verdict.budgets:  # a shared verdict's list stays its own
            record.budgets = verdict.budgets
        record.baseline = verdict.baseline
        if self.ranks is not None:
            record = self.ranks.exchange(record, measurement.entry)
        if self.junit_properties:
            # A rerun's properties replace the earlier run's (pytest-rerunfailures).
            earlier = item.stash.get(PROPERTIES, None)
            if earlier:
                item.user_properties[:] = [p for p in item.user_properties if p not in earlier]
            properties = item.stash[PROPERTIES] = list(junit_properties(record))
            item.user_properties.extend(properties)
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

    def collect_worker_report(self, report: pytest.TestReport) -> None:
        """Keep the record a pytest-xdist worker sent on ``report``, if it carries one."""
        data = getattr(report, "vram_record", None)
        if report.when == "teardown" and data is not None:
            self._collect(TestRecord.from_dict(data), getattr(report, "vram_environment", None))
            for note in getattr(report, "vram_notes", ()):
                if note not in self.notes:
                    self.notes.append(note)

    def discard(self, record: TestRecord) -> None:
        """Forget a record collected for a run of a test that is run again."""
        self.records[:] = [kept for kept in self.records if kept is not record]

    def _collect(self, record: TestRecord, environment: dict[str, Any] | None) -> None:
        earlier = self._collected.get(record.nodeid)
        if earlier is not None:  # the test ran again on its worker: its last run is reported
            self.discard(earlier)
        self._collected[record.nodeid] = record
        self.records.append(record)
        if environment:
            self.environments.setdefault(record.backend, environment)

    def stale_entries(self) -> list[str]:
        """Baseline entries of tests that no longer exist."""
        nodeids = {n for baseline in self.store.files.values() for n in baseline.entries}
        return self.selection.stale(nodeids)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.pool.pause_all()
        self.notes[:0] = [note for note in self.pool.notes if note not in self.notes]
        if self.ranks is not None:
            self.ranks.close()
            self.notes += self.ranks.notes
        if not self.reports:
            return
        self._add_suite_properties()
        if not self.settings.update_baselines:
            self.notes += self._counter_changes()
            for path, message in self._environment_changes():
                self._warn_run(session, path, message)
        if self.settings.report and not self.settings.prune_baselines:
            stale = self.stale_entries() if self.selection.collected is not None else []
            for baseline in self.store.files.values():
                in_file = [nodeid for nodeid in stale if nodeid in baseline.entries]
                if in_file:
                    self._warn_run(session, baseline.path, _stale_warning(in_file))
        writer = BaselineWriter(self.store, self.environments)
        if self.settings.update_baselines:
            writer.update(self.records)
        if self.settings.prune_baselines:
            if self.selection.collected is None:
                self.notes.append(
                    "--vram-prune-baselines needs the collection, which this process did not "
                    "see (pytest-xdist): run it without -n"
                )
            else:
                writer.prune(self.stale_entries())
        saved = writer.save()
        if self.settings.update_baselines and not (saved.lines or saved.errors):
            stored = sum(1 for record in self.records if record.outcome == "passed")
            saved.lines.append(
                f"baselines: no change in {_shown_path(self.settings.baseline_dir)} "
                f"({stored} {'test' if stored == 1 else 'tests'} measured, figures as stored)"
            )
        written = saved + write_outputs(
            lambda: build_document(self.records, self.environments, self._run_facts()),
            self.settings,
            os.environ.get("GITHUB_STEP_SUMMARY"),
        )
        self.notes += written.notes()
        fail_on_errors(session, written)
        self.notes += self.snapshots.notes()

    def _run_facts(self) -> dict[str, Any]:
        """What merging this run's --vram-json into the baselines needs (see shards.py)."""
        collected = self.selection.collected is not None
        return {
            "measured": "all" if self.settings.measure_all else "marked",
            "stale": self.stale_entries() if collected else None,
        }

    def _counter_changes(self) -> list[str]:
        """Baselines measured with the other cpu counter: their peaks are not this run's kind."""
        notes = []
        for environment in self.environments.values():
            stored = self.store.files.get(environment.get("device", ""))
            then = stored.environment.get("cpu_counter") if stored is not None else None
            now = environment.get("cpu_counter")
            if then and now and then != now:
                notes.append(
                    f"the baselines in {stored.path.name} were measured with the {then} cpu "
                    f"counter and this run counts with the {now} counter: their peaks differ by "
                    "what kernels allocate for themselves (--vram-cpu-counter chooses)"
                )
        return notes

    def _environment_changes(self) -> list[tuple[Path, str]]:
        """Baselines measured under another torch, CUDA, driver or pytest-vram: their figures
        may differ for that reason alone."""
        messages = []
        for environment in self.environments.values():
            stored = self.store.files.get(environment.get("device", ""))
            if stored is None or not stored.entries:
                continue
            changed = [
                f"{name} {stored.environment[name]} -> {environment[name]}"
                for name in _ENVIRONMENT_FIELDS
                if name in stored.environment
                and name in environment
                and str(stored.environment[name]) != str(environment[name])
            ]
            if changed:
                messages.append(
                    (
                        stored.path,
                        f"the baselines in {stored.path.name} were measured in another environment "
                        f"({', '.join(changed)}); update them with --vram-update-baselines once "
                        "the figures are confirmed",
                    )
                )
        return messages

    def _warn_run(self, session: pytest.Session, path: Path, message: str) -> None:
        """A warning about a baseline file, told at the file; escalated by ``-W error``, it
        fails the run."""
        try:
            warnings.warn_explicit(VramWarning(message), VramWarning, _shown_path(path), 1)
        except VramWarning:
            self.notes.append(f"error: {message} (VramWarning, an error under -W)")
            if session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
                session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def _add_suite_properties(self) -> None:
        try:
            from _pytest.junitxml import xml_key
        except ImportError:  # pragma: no cover - pytest moved it
            return
        xml = self.config.stash.get(xml_key, None)
        if xml is None or not self.junit_properties:
            return
        for name, value in suite_properties(self.environments):
            xml.add_global_property(name, value)

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if not self.reports:
            return
        if self.settings.report:
            terminalreporter.write_sep("=", "vram report")
            # One write: a line at a time costs milliseconds per thousand tests.
            lines = terminal_lines(self.records, self.stale_entries())
            terminalreporter.write("\n".join(lines) + "\n")
        for note in self.notes:
            terminalreporter.write_line(f"pytest-vram: {note}")


def _shown_path(path: Path) -> str:
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


# The environment fields whose change alone can change a test's figures.
_ENVIRONMENT_FIELDS = ("torch", "cuda", "hip", "driver", "pytest_vram", "allocator", "alloc_conf")


def _stale_warning(stale: list[str]) -> str:
    shown = ", ".join(stale[:3]) + (f" and {len(stale) - 3} more" if len(stale) > 3 else "")
    entries, them = ("entry has", "it") if len(stale) == 1 else ("entries have", "them")
    return (
        f"{len(stale)} baseline {entries} no test any more ({shown}); "
        f"--vram-prune-baselines removes {them}"
    )


def _failed_instead(
    item: pytest.Item, call: pytest.CallInfo[None], message: str
) -> pytest.TestReport:
    """The report of ``call`` had it failed with ``message`` (pytest.fail, no traceback)."""
    try:
        # Not chained to the cause: the message stands for it, and says all.
        raise pytest.fail.Exception(message, pytrace=False) from None
    except pytest.fail.Exception:
        call.excinfo = pytest.ExceptionInfo.from_current()
    return pytest.TestReport.from_item_and_call(item, call)


def _with_late_sections(item: pytest.Item, report: pytest.TestReport) -> pytest.TestReport:
    """The sections added to the test after pytest made its report (the allocator's state at
    an OOM, the snapshot's path) put on the report too."""
    for when, key, content in getattr(item, "_report_sections", ()):
        section = (f"Captured {key} {when}", content)
        if when == report.when and section not in report.sections:
            report.sections.append(section)
    return report


def _first_line_of(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def _warn(item: pytest.Item, verdict: Verdict) -> Verdict:
    """Issue a verdict's warnings at the test's own location, in its call, where pytest records
    them for the test; one that a filter turns into an error
    (``-W error::pytest_vram.VramWarning``) fails the test."""
    escalated = []
    for message in verdict.warnings:
        try:
            item.warn(VramWarning(message))
        except VramWarning:
            escalated.append(f"{message} (VramWarning, an error under -W)")
    if not escalated:
        return verdict
    return dataclasses.replace(
        verdict, status=Status.FAILED, failures=[*verdict.failures, *escalated]
    )


class BroaderFixtures:
    """The fixture hooks of a session whose measured tests have broader-scoped fixtures."""

    def __init__(self, session: VramSession) -> None:
        self.session = session
        #: Per broader-scoped fixture being made or made: OLD_GARBAGE.freezes then.
        self._made: dict[Any, int] = {}

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
        if fixturedef.scope == "function":
            return (yield)
        self._made[fixturedef] = OLD_GARBAGE.freezes
        measurement = self.session.current
        if measurement is None:
            return (yield)
        # A broader-scoped fixture made in this test's setup counts with what it holds once
        # made, as it does in a later test that finds it made.
        view = measurement.backend
        view.enter_excluded(fixturedef.argname, measurement.reset_peak)
        try:
            return (yield)
        finally:
            view.exit_excluded()

    def pytest_fixture_post_finalizer(self, fixturedef: Any) -> None:
        # What a broader-scoped fixture held may be garbage in the oldest generation now.
        if fixturedef.scope != "function":
            # Made before this plugin was registered: it may have been frozen since.
            OLD_GARBAGE.let_go(made_at=self._made.pop(fixturedef, -1))


class FinalReports:
    """Reads the reports of a measured test's setup and call as pytest logs them, after every
    plugin's say (a strict XPASS fails only there)."""

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_makereport(  # type: ignore[no-untyped-def]
        self, item: pytest.Item, call: pytest.CallInfo[None]
    ):
        report = yield
        if (
            report.failed
            and call.when != "teardown"
            and MEASUREMENT in item.stash
            and not item.stash.get(IN_CALL, False)  # not a subtest's
        ):
            item.stash[REPORTED_FAILED] = True
        return report


class ControllerReports:
    """On a pytest-xdist controller: hands the records that ride on the workers' reports to
    the session. A process that runs its own tests has no reports to read."""

    def __init__(self, session: VramSession) -> None:
        self.session = session

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.session.collect_worker_report(report)


class WorkerReports:
    """On a pytest-xdist worker: each record rides to the controller on its teardown report,
    whose ``pytest_runtest_logreport`` there hands it to the controller's session."""

    def __init__(self, session: VramSession) -> None:
        self.session = session

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
        report = yield
        record = item.stash.get(RECORD, None)
        if call.when == "teardown" and record is not None:
            # Plain data: pytest-xdist serialises the report, attributes included.
            report.vram_record = record.to_dict()
            report.vram_environment = self.session.environments.get(record.backend, {})
            report.vram_notes = list(self.session.notes) + list(self.session.pool.notes)
        return report
