"""The per-test hooks: start a measurement before setup, judge it after the call, finish it after
teardown, and hand the record to whoever writes the reports.

Data flows one way: backend -> measurement -> record -> the session's records -> baselines and
reports. Under pytest-xdist the record travels from the worker to the controller as plain data on
the teardown report, and only the controller writes.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import pytest
import torch

from pytest_vram import __version__
from pytest_vram.backends import Backend, BackendUnavailable, create_backend, resolve_name
from pytest_vram.baselines import BaselineStore, compare_with_entry
from pytest_vram.marks import MarkerError, VramMarks, read_marks
from pytest_vram.measurement import TestMeasurement
from pytest_vram.options import Settings
from pytest_vram.records import BudgetResult, TestRecord
from pytest_vram.report import build_document, junit_properties, terminal_lines
from pytest_vram.scenarios import LeakError
from pytest_vram.snapshots import SnapshotRecorder
from pytest_vram.units import describe_size, format_size
from pytest_vram.writer import BaselineWriter, fail_on_errors, write_outputs

__all__ = ["MEASUREMENT", "VramSession", "WorkerReports"]

VRAM_FIXTURES = frozenset({"vram", "vram_empty_cache", "vram_single_step", "vram_leak_check"})
MEASUREMENT = pytest.StashKey[TestMeasurement]()
# Set on the tests that are measured: their parsed markers.
MARKS = pytest.StashKey[VramMarks]()
MARKER_ERROR = pytest.StashKey[MarkerError]()
VERDICT = pytest.StashKey["Verdict"]()
RECORD = pytest.StashKey[TestRecord]()
# The environment a JUnit suite names in vram_env_* properties.
_SUITE_ENVIRONMENT_KEYS = (
    "backend",
    "device",
    "cpu_counter",
    "torch",
    "cuda",
    "driver",
    "total_memory",
)


@dataclass
class Verdict:
    """What setup and the call decided about memory."""

    status: str | None = None
    raised: bool = False
    #: What setup or the call raised (a failure or a skip): its frames hold the test's tensors.
    exception: BaseException | None = None
    messages: list[str] = field(default_factory=list)


def is_out_of_memory(exc: BaseException) -> bool:
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    # The CPU allocator reports exhaustion as a plain RuntimeError.
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def release_frames(exc: BaseException | None) -> None:
    """Drop the locals of the frames in ``exc``'s tracebacks, and in those of the exceptions
    it chains to, so that the tensors they hold are freed."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        traceback.clear_frames(tb)
        if tb is not None:
            _clear_finished_callers(tb.tb_frame)
        while tb is not None:
            # Python 3.11 keeps a materialised f_locals dict after frame.clear(); reading it
            # again syncs it with the now empty frame.
            tb.tb_frame.f_locals  # noqa: B018
            tb = tb.tb_next
        if exc.__cause__ is not None:
            release_frames(exc.__cause__)
        exc = exc.__context__


def _clear_finished_callers(frame: FrameType) -> None:
    """Clear the finished frames that called ``frame``: pytest's CallInfo for the failed call
    sits in one of them, and with the traceback it forms a cycle that keeps the test's
    closures alive. The first frame still running ends the walk."""
    caller = frame.f_back
    while caller is not None:
        try:
            caller.clear()
        except RuntimeError:  # still executing: everything above it is too
            return
        caller = caller.f_back


class VramSession:
    """The plugin's state for one pytest session (one per xdist worker, and the controller)."""

    def __init__(self, config: pytest.Config, settings: Settings, store: BaselineStore) -> None:
        self.config = config
        self.settings = settings
        self.store = store
        self.is_worker = hasattr(config, "workerinput")
        # The properties go to --junitxml (on xdist workers too: they share the options).
        self.junit_properties = settings.junit_properties and bool(
            config.getoption("xmlpath", None)
        )
        self.backends: dict[str, Backend] = {}
        self.last_end: dict[str, int] = {}
        self.records: list[TestRecord] = []
        self.environments: dict[str, dict[str, Any]] = {}
        self.collected: set[str] | None = None
        self.notes: list[str] = []
        self.snapshots = SnapshotRecorder(settings.snapshot_dir)

    def close(self) -> None:
        for backend in self.backends.values():
            backend.close()
        self.backends.clear()

    # -- which tests are measured ---------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        # tryfirst: the full collection, before -k/-m deselect, tells stale baseline entries.
        self.collected = {item.nodeid for item in items}

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        # After every plugin's modifyitems, so that the markers they add count. Reading them
        # here, once, also keeps the parsing out of each test's setup.
        measure_all = self.settings.report or self.settings.update_baselines
        for item in session.items:
            try:
                marks, invalid = read_marks(list(item.iter_markers())), False
            except MarkerError as exc:
                item.stash[MARKER_ERROR] = exc  # the test's setup reports it, naming the test
                marks, invalid = VramMarks(), True
            if (
                measure_all
                or invalid
                or marks.any
                or not VRAM_FIXTURES.isdisjoint(getattr(item, "fixturenames", ()))
            ):
                item.stash[MARKS] = marks

    def backend(self, name: str) -> Backend:
        name = resolve_name(name)
        if name not in self.backends:
            backend = create_backend(
                name,
                cpu_counter=self.settings.cpu_counter,
                sim_capacity=self.settings.sim_capacity,
            )
            self.notes += backend.notes()
            self.backends[name] = backend
            self.last_end[name] = backend.allocated()
            env = backend.environment()
            env["pytest_vram"] = __version__
            self.environments[name] = env
        return self.backends[name]

    # -- the test's phases ----------------------------------------------------------------

    # trylast: the innermost wrapper, so the measurement starts right before fixtures are set
    # up, and a skip or failure raised here passes through the other plugins' wrappers.
    @pytest.hookimpl(wrapper=True, trylast=True)
    def pytest_runtest_setup(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        marks = item.stash.get(MARKS, None)
        if marks is None:  # not measured
            self._pause_backends()
            return (yield)
        self._begin(item, marks)
        try:
            return (yield)
        except pytest.skip.Exception as exc:  # a skip or skipif marker, or a fixture's skip
            item.stash[VERDICT] = Verdict(status="skipped", exception=exc)
            raise
        except BaseException as exc:
            item.stash[VERDICT] = Verdict(status="failed", raised=True, exception=exc)
            raise

    def _pause_backends(self, keep: Backend | None = None) -> None:
        """Backends may go on watching after a test ends; stop all (but ``keep``) before other
        code runs, so that an unmeasured test runs exactly as without the plugin."""
        for backend in self.backends.values():
            if backend is not keep:
                backend.pause()

    def _begin(self, item: pytest.Item, marks: VramMarks) -> None:
        try:
            if MARKER_ERROR in item.stash:
                raise item.stash[MARKER_ERROR]
            backend = self.backend(marks.backend or self.settings.backend)
        except (MarkerError, BackendUnavailable) as exc:
            problem = f"usage error in {item.nodeid}: {exc}"
        else:
            problem = None
        if problem is not None:
            pytest.fail(problem, pytrace=False)
        self._pause_backends(keep=backend)
        if marks.required is not None:
            total = backend.total_memory()
            if total is not None and total < marks.required:
                pytest.skip(
                    f"requires_vram({describe_size(marks.required_typed)}): the {backend.name} "
                    f"device has {format_size(total)}"
                )
        self._clean(backend)
        measurement = TestMeasurement(backend, item.nodeid)
        self.snapshots.start(backend)
        measurement.begin()
        item.stash[MEASUREMENT] = measurement

    def _clean(self, backend: Backend) -> None:
        """Collect what earlier tests left and empty the allocator cache, so that this test's
        figures do not depend on which tests ran before it."""
        if backend.allocated() > self.last_end[backend.name]:
            import gc

            gc.collect()
        backend.release_cache()

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        measurement = item.stash.get(MEASUREMENT, None)
        if measurement is None:
            return (yield)
        verdict = item.stash[VERDICT] = Verdict()
        try:
            result = yield
        except pytest.skip.Exception as exc:
            measurement.finish_call()
            verdict.status = "skipped"
            verdict.exception = exc
            raise
        except BaseException as exc:
            measurement.finish_call()
            verdict.raised = True
            verdict.exception = exc
            self._check_budgets(item, measurement, verdict)
            self._on_error(item, measurement, exc, verdict)
            raise
        measurement.finish_call()
        self._judge(item, measurement, verdict)
        return result

    def _on_error(
        self, item: pytest.Item, measurement: TestMeasurement, exc: BaseException, verdict: Verdict
    ) -> None:
        backend = measurement.backend
        if is_out_of_memory(exc) or isinstance(exc, LeakError):
            verdict.messages.append(str(exc).strip().splitlines()[0])
        if is_out_of_memory(exc):
            verdict.status = "oom"
            summary = backend.memory_summary()
            if summary:
                item.add_report_section("call", "vram allocator state", summary)
        elif isinstance(exc, LeakError):
            verdict.status = "leak"
        elif verdict.status is None:
            verdict.status = "failed"
        path = self.snapshots.dump(backend, item.nodeid)
        if path is not None:
            item.add_report_section("call", "vram snapshot", f"allocator snapshot: {path}")
        explanation = backend.explain_error(exc)
        if explanation is not None:
            raise pytest.fail.Exception(explanation, pytrace=False) from exc

    def _check_budgets(
        self, item: pytest.Item, measurement: TestMeasurement, verdict: Verdict
    ) -> None:
        budgets = item.stash[MARKS].budgets
        if not budgets:
            return
        record = measurement.record
        peaks = {
            "allocated": record.peak_allocated,
            "reserved": record.peak_reserved,
            "device": record.peak_device,
        }
        for budget in budgets:
            peak = peaks[budget.metric]
            if peak is None:
                verdict.messages.append(
                    f"max_vram(metric={budget.metric!r}) cannot be checked: the "
                    f"{record.backend} backend does not measure {budget.metric} memory"
                    + self._why_missing(measurement.backend, budget.metric)
                )
                verdict.status = verdict.status or "over-budget"
                passed = False
            else:
                passed = peak <= budget.limit
                if not passed:
                    verdict.status = verdict.status or "over-budget"
                    verdict.messages.append(
                        f"peak {budget.metric} memory {format_size(peak)} exceeds "
                        f"max_vram({describe_size(budget.typed)}) by "
                        f"{format_size(peak - budget.limit)}"
                    )
            record.budgets.append(
                BudgetResult(budget.limit, budget.metric, peak, str(budget.typed), passed)
            )

    @staticmethod
    def _why_missing(backend: Backend, metric: str) -> str:
        note = getattr(backend, "nvml_note", None)
        if metric == "device" and note:
            return f" ({note})"
        return ""

    def _judge(self, item: pytest.Item, measurement: TestMeasurement, verdict: Verdict) -> None:
        """Budgets, then the baseline: fail the test with every reason at once."""
        __tracebackhide__ = True
        self._check_budgets(item, measurement, verdict)
        if not self.settings.update_baselines:
            self._compare_with_baseline(item, measurement.record, verdict)
        if verdict.messages:
            verdict.raised = True
            pytest.fail("\n".join(verdict.messages), pytrace=False)

    def _compare_with_baseline(
        self, item: pytest.Item, record: TestRecord, verdict: Verdict
    ) -> None:
        entry = self.store.entry(record.device, record.nodeid)
        if entry is None:
            verdict.status = verdict.status or "new"
            if self.settings.strict:
                verdict.status = "failed" if verdict.status == "new" else verdict.status
                verdict.messages.append(
                    f"no baseline for {record.nodeid} on device {record.device!r} in "
                    f"{self.settings.baseline_dir} (--vram-strict); record one with "
                    f"pytest --vram-update-baselines {record.nodeid}"
                )
            return
        record.baseline = dict(entry)
        tolerance = item.stash[MARKS].tolerance or self.settings.tolerance
        changes = compare_with_entry(record.figures(), entry, tolerance)
        regressions = [change for change in changes if change.regressed]
        hint = (
            "if this is intended, update the baseline: "
            f"pytest --vram-update-baselines {record.nodeid}"
        )
        if regressions:
            verdict.status = verdict.status or "regression"
            verdict.messages += [f"memory regression: {c.describe()}" for c in regressions]
            verdict.messages.append(hint)
        elif any(change.improved for change in changes):
            verdict.status = verdict.status or "improved"
            record.messages += [f"improved: {c.describe()}" for c in changes if c.improved]
            record.messages.append(hint)
        else:
            verdict.status = verdict.status or "ok"

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_teardown(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        try:
            return (yield)
        finally:
            measurement = item.stash.get(MEASUREMENT, None)
            if measurement is not None:
                self._finish(item, measurement)

    def _finish(self, item: pytest.Item, measurement: TestMeasurement) -> None:
        verdict = item.stash.get(VERDICT, None)
        if verdict is None:  # the call never ran (--setup-only, --setup-plan)
            verdict = Verdict(status="skipped")
        if verdict.exception is not None:
            # The frames of a failed or skipped test still hold its tensors, through the
            # exception pytest keeps for the report and, after a failed call, for post-mortem
            # debugging (sys.last_value, dropped only in the next test's call). Drop those
            # references and clear the frames, so that the next test starts clean.
            release_frames(verdict.exception)
            if getattr(sys, "last_value", None) is verdict.exception:
                for name in ("last_type", "last_value", "last_traceback", "last_exc"):
                    if hasattr(sys, name):
                        delattr(sys, name)
        # pytest drops the test's fixture values only after the teardown report; drop them now,
        # or what the test's function-scoped fixtures held would count as left over.
        funcargs = getattr(item, "funcargs", None)
        if isinstance(funcargs, dict):
            funcargs.clear()
        measurement.end()
        record = measurement.record
        self.last_end[record.backend] = record.end_allocated
        if verdict.status == "skipped":
            record.outcome = "skipped"
        else:
            record.outcome = "failed" if verdict.raised else "passed"
        record.status = verdict.status or ("failed" if verdict.raised else "ok")
        record.messages = verdict.messages + record.messages
        if self.junit_properties:
            item.user_properties.extend(junit_properties(record))
        if self.is_worker:
            item.stash[RECORD] = record  # for WorkerReports, on the teardown report
        else:
            self._collect(record, self.environments.get(record.backend))

    # -- the controller: collect records, write reports -----------------------------------

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = getattr(report, "vram_record", None)
        if report.when == "teardown" and data is not None:
            self._collect(TestRecord.from_dict(data), getattr(report, "vram_environment", None))
            for note in getattr(report, "vram_notes", ()):
                if note not in self.notes:
                    self.notes.append(note)

    def _collect(self, record: TestRecord, environment: dict[str, Any] | None) -> None:
        self.records.append(record)
        if environment:
            self.environments.setdefault(record.backend, environment)

    def stale_entries(self) -> list[str]:
        """Baseline entries of tests that no longer exist. A file counts only where this run
        collected the whole of it (a path argument, not ``file::test``), or where it is gone:
        a partial run says nothing of the tests it did not collect."""
        if self.collected is None:
            return []
        root = self.config.rootpath
        partial = {arg.split("::")[0] for arg in self.config.args if "::" in arg}
        partial_paths = {(self.config.invocation_params.dir / p).resolve() for p in partial}
        collected_files = {nodeid.split("::")[0] for nodeid in self.collected}
        stale = set()
        for baseline in self.store.files.values():
            for nodeid in baseline.entries:
                if nodeid in self.collected:
                    continue
                path = nodeid.split("::")[0]
                gone = not (root / path).exists()
                whole = path in collected_files and (root / path).resolve() not in partial_paths
                if gone or whole:
                    stale.add(nodeid)
        return sorted(stale)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self._pause_backends()
        if self.is_worker:
            return
        self._add_suite_properties()
        if not self.settings.update_baselines:
            self.notes += self._counter_changes()
        writer = BaselineWriter(self.store, self.environments)
        if self.settings.update_baselines:
            writer.update(self.records)
        if self.settings.prune_baselines:
            if self.collected is None:
                self.notes.append(
                    "--vram-prune-baselines needs the collection, which this process did not "
                    "see (pytest-xdist): run it without -n"
                )
            else:
                writer.prune(self.stale_entries())
        written = writer.save() + write_outputs(
            lambda: build_document(self.records, self.environments),
            self.settings,
            os.environ.get("GITHUB_STEP_SUMMARY"),
        )
        self.notes += written.notes()
        fail_on_errors(session, written)
        self.notes += self.snapshots.notes()

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

    def _add_suite_properties(self) -> None:
        try:
            from _pytest.junitxml import xml_key
        except ImportError:  # pragma: no cover - pytest moved it
            return
        xml = self.config.stash.get(xml_key, None)
        if xml is None or not self.junit_properties:
            return
        for name, environment in sorted(self.environments.items()):
            prefix = "vram_env" if len(self.environments) == 1 else f"vram_env_{name}"
            for key in _SUITE_ENVIRONMENT_KEYS:
                if environment.get(key) is not None:
                    xml.add_global_property(f"{prefix}_{key}", str(environment[key]))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        if self.is_worker:
            return
        if self.settings.report:
            terminalreporter.write_sep("=", "vram report")
            # One write: a line at a time costs milliseconds per thousand tests.
            lines = terminal_lines(self.records, self.stale_entries())
            terminalreporter.write("\n".join(lines) + "\n")
        for note in self.notes:
            terminalreporter.write_line(f"pytest-vram: {note}")


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
            report.vram_notes = list(self.session.notes)
        return report
