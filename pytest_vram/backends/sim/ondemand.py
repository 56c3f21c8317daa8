"""Values on demand: a test on the simulated device runs shape-only, and computes where it must.

Shape-only, the ``sim`` backend's tensors are fake: nothing is computed, any model size fits,
and a test that reads a value (``.item()``, a value assert, a ``DataLoader``, ``.numpy()``,
``generate()``) fails. Such a test is run again, its whole protocol (setup, call, teardown), on
real CPU tensors, where the simulated device counts the same allocations the same way; only
the second run is reported. A shape-only failure that memory explains (a budget, a regression,
a leak check, the simulated device's out-of-memory) is the same when computing and is not run
again; any other failure is, so that the reported outcome is the one of a run that computed.

The unit is the test file. A file one of whose tests needed values computes its remaining tests
in this run, and from the next run on all of them, from the start: the file is remembered in
pytest's cache (``vram/needs_values``; ``--cache-clear`` forgets). A file the cache knows
nothing of, run right after a file that computed, computes too, on a guess: test files next to
each other tend to be alike. A guess may hold little host memory (``sim.GUESS_BUDGET``). A test
that fails on a guess (past that budget, or for any reason but a memory verdict) runs again as
without it, shape-only first, and so does the rest of its file, remembered as such
(``vram/shape_only``), unless the shape-only run fails too (for any reason but memory): then
the guess's run stands and its file stays on a guess. Either way the figures are the same.
Fixtures of a broader scope made in one mode hold tensors the other cannot use (fake ones cannot
give values, real ones are not the shape-only device's), so a test of the other mode finds them
torn down and made anew.

Subtests (pytest's ``subtests`` fixture, ``unittest``'s ``self.subTest``) report while the test
runs. In a run that is tried again if it fails, the first failing subtest ends the run at once
(:class:`RunAgain`), and the reports of the subtests that passed before it are held back: shown
after the run if it is not run again, dropped if it is, so that each subtest has one outcome.
Under pytest-rerunfailures each of its runs is such a run, shape-only first.

A shape-only attempt that takes the process down (native code on fake tensors) is found by the
next run, which computes that test from the start (:mod:`~pytest_vram.backends.sim.attempts`).
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Protocol

import pytest
from _pytest.runner import runtestprotocol

from pytest_vram.backends import resolve_name
from pytest_vram.backends.sim.attempts import ShapeOnlyAttempts
from pytest_vram.backends.sim.plainrun import PlainTests, fails_only_simulated, passed, run_plain
from pytest_vram.backends.sim.runmodes import (
    COMPUTING,
    COMPUTING_BECAUSE,
    MAY_RUN_AGAIN,
    ON_A_GUESS,
    RunAgain,
    failed_or_xfailed,
    first_failure_line,
    run_again,
)
from pytest_vram.errors import LeakError
from pytest_vram.raised import is_out_of_memory, release_quietly

__all__ = ["HELD_BACK", "NEEDS_VALUES_CACHE_KEY", "SHAPE_ONLY_CACHE_KEY", "ValuesOnDemand"]

#: pytest's cache key of the test files that compute their values.
NEEDS_VALUES_CACHE_KEY = "vram/needs_values"
#: pytest's cache key of the test files one of whose tests failed on a guess.
SHAPE_ONLY_CACHE_KEY = "vram/shape_only"
#: The attribute of a subtest's report that is held back until its run is known to stand.
HELD_BACK = "vram_held"
# The attributes a report carries to the controller under xdist: the file of a test that
# needed values, of one that failed on a guess.
_REPORT_ATTRIBUTE = "vram_needs_values"
_SHAPE_ONLY_ATTRIBUTE = "vram_shape_only"
# Why a test computes whose shape-only run took a process down (the run's notes say when).
_CRASHED = "a shape-only run of this test took its process down in an earlier run"


def test_file_of(item: pytest.Item) -> str:
    """The test file of ``item``, as its node id names it."""
    return item.nodeid.split("::", 1)[0]


class MeasuredTests(PlainTests, Protocol):
    """What values on demand asks the session of a measured test."""

    def backend_of(self, item: pytest.Item) -> str | None:
        """The backend its ``vram_backend`` marker names, "" for the run's own, None when the
        test is not measured (or its markers are malformed)."""

    def raised_in(self, item: pytest.Item) -> BaseException | None:
        """What its setup or call raised in the run that just ended."""

    def forget(self, item: pytest.Item) -> None:
        """Forget the record and the measurement of a run that is run again."""

    def set_aside(self, item: pytest.Item) -> Any:
        """Forget the run that just ended, keeping what ``restore`` needs to make it stand."""

    def restore(self, item: pytest.Item, kept: Any) -> None:
        """Forget the run that just ended: the run set aside stands after all."""


class ValuesOnDemand:
    """Runs each test on the simulated device shape-only or computing, and reruns a shape-only
    failure computing. ``policy`` is ``--vram-sim-compute``'s value and ``backend`` the
    backend a test without a ``vram_backend`` marker runs on; ``tests`` is what the session
    knows of each measured test."""

    def __init__(
        self,
        config: pytest.Config,
        *,
        policy: str,
        backend: str,
        tests: MeasuredTests,
        xdist_controller: bool = False,
    ) -> None:
        self.config = config
        # A pytest-xdist controller runs no test: its workers decide for themselves.
        self._xdist_controller = xdist_controller
        self.policy = policy
        self.backend = backend
        self._tests = tests
        cache = getattr(config, "cache", None)
        #: Test files remembered as needing values when the run started.
        self.remembered = _files_in_cache(cache, NEEDS_VALUES_CACHE_KEY)
        #: Test files that compute in this run.
        self.computing: set[str] = set(self.remembered)
        #: Test files found to need values in this run (by this process, or an xdist worker).
        self.found: set[str] = set()
        #: Test files remembered to have failed on a guess: never guessed again.
        self.remembered_shape_only = _files_in_cache(cache, SHAPE_ONLY_CACHE_KEY)
        #: Test files that start shape-only in this run (until one of their tests needs
        #: values), and those found to have failed on a guess.
        self.shape_only: set[str] = set(self.remembered_shape_only)
        self.found_shape_only: set[str] = set()
        #: Test files that compute on a guess in this run.
        self.guessed: set[str] = set()
        # Whether the file of the sim test that ran last computes.
        self._last_computed = False
        # Per broader-scoped fixture: whether it was made for a computing test.
        self._made_in: dict[Any, bool] = {}
        # While a test runs: whether it computes.
        self._computing_now: bool | None = None
        self._resolved: dict[str, str] = {}
        #: The reports of the subtests that passed in the run in progress, held back.
        self._held: list[pytest.TestReport] = []
        #: Each shape-only attempt, recorded while it runs: a run after one that died in it
        #: computes the test instead (``crashed``).
        self.attempts = ShapeOnlyAttempts(cache, reads=not hasattr(config, "workerinput"))
        #: What the run's end says: the tests whose memory was not simulated, and why.
        self.notes: list[str] = []

    def _on_sim(self, item: pytest.Item) -> bool:
        named = self._tests.backend_of(item)
        if named is None:
            return False
        name = named or self.backend
        if name not in self._resolved:
            try:
                self._resolved[name] = resolve_name(name)
            except Exception:  # the session reports an unusable backend itself
                self._resolved[name] = name
        return self._resolved[name] == "sim"

    # -- the protocol ---------------------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> None:
        # A session none of whose tests runs on the simulated device pays nothing for this
        # plugin's hooks. A pytest-xdist controller runs no test but hears what its workers
        # found.
        if self._xdist_controller or any(self._on_sim(item) for item in session.items):
            return
        self.config.pluginmanager.unregister(self)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_protocol(self, item: pytest.Item, nextitem: pytest.Item | None) -> Any:
        if self.policy == "never" or not self._on_sim(item):
            return None
        rerunfailures = self._rerunfailures
        if rerunfailures is not None:
            # pytest-rerunfailures runs the protocol of a test it may rerun, and logs its
            # reports: each of its runs is one of values on demand.
            original = rerunfailures.runtestprotocol
            rerunfailures.runtestprotocol = self._protocol_for_rerunfailures
            try:
                if rerunfailures.pytest_runtest_protocol(item=item, nextitem=nextitem):
                    return True
            finally:
                rerunfailures.runtestprotocol = original
        ihook = item.ihook
        ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        for report in self.runtestprotocol(item, nextitem):
            ihook.pytest_runtest_logreport(report=report)
        ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True

    @property
    def _rerunfailures(self) -> Any:
        """pytest-rerunfailures' module, where it is active and runs tests as this plugin
        knows it to; None otherwise."""
        module = sys.modules.get("pytest_rerunfailures")
        if (
            module is None
            or not self.config.pluginmanager.is_registered(module)
            or getattr(module, "runtestprotocol", None) is not runtestprotocol
            or not callable(getattr(module, "pytest_runtest_protocol", None))
        ):
            return None
        return module

    def _protocol_for_rerunfailures(
        self, item: pytest.Item, nextitem: pytest.Item | None = None, log: bool = True
    ) -> list[pytest.TestReport]:
        reports = self.runtestprotocol(item, nextitem)
        if log:
            for report in reports:
                item.ihook.pytest_runtest_logreport(report=report)
        return reports

    def runtestprotocol(
        self, item: pytest.Item, nextitem: pytest.Item | None
    ) -> list[pytest.TestReport]:
        """Run ``item``'s protocol shape-only or computing, again in the other mode where
        that may change its outcome; the reports of the run that stands, not logged. The
        reports of the subtests held back in a run that stands are logged here."""
        module = test_file_of(item)
        if item.nodeid in self.attempts.crashed:
            # Its shape-only run took a process down: it computes, and no guess is tried.
            self._last_computed = True
            return self._run(item, nextitem, True, _CRASHED)
        computing, guess = self._mode_of(module)
        saved = (list(item.user_properties), list(getattr(item, "_report_sections", [])))
        reports = self._run(item, nextitem, computing, guess=guess)
        guessed_wrong = guess and self._worth_another_mode(item, reports, guessed=True)
        guess_run = None
        if guessed_wrong:
            # Run as without the guess, and its file from now on: shape-only first.
            self.guessed.discard(module)
            self.shape_only.add(module)
            if self._within_budget(item):
                # What computing with the whole budget would give, should shape-only want values.
                guess_run = self._set_aside(item, reports, saved)
            else:
                self._forget(item, saved)
            computing = False
            reports = self._run(item, nextitem, False)
        if not computing and self._worth_another_mode(item, reports):
            reason = first_failure_line(reports)
            if guess_run is not None:
                # Shape-only failed too: the guess was no worse, and its file stays on a guess.
                reports = self._restore(item, guess_run, reason)
                guessed_wrong = False
                self.shape_only.discard(module)
                self.guessed.add(module)
            else:
                self._forget(item, saved)
                reports = self._run(item, nextitem, True, reason)
            if not failed_or_xfailed(reports):
                # The values were what the shape-only run lacked.
                self.computing.add(module)
                for report in reports:
                    setattr(report, _REPORT_ATTRIBUTE, module)
        # Failed (an xfail is the outcome plain pytest gives too), and memory does not say why.
        if any(r.failed for r in reports) and self._worth_another_mode(item, reports):
            reports = self._backstop(item, nextitem, reports, saved)
        self._last_computed = module in self.computing or module in self.guessed
        if guessed_wrong:
            for report in reports:
                setattr(report, _SHAPE_ONLY_ATTRIBUTE, module)
        held, self._held = self._held, []
        for report in held:
            item.ihook.pytest_runtest_logreport(report=report)
        return reports

    def _backstop(
        self,
        item: pytest.Item,
        nextitem: pytest.Item | None,
        reports: list[pytest.TestReport],
        saved: tuple[list, list],
    ) -> list[pytest.TestReport]:
        """Run a test that failed on the simulated device as without the plugin (see
        :mod:`~pytest_vram.backends.sim.plainrun`); the reports that stand."""
        tests = self._tests
        if not tests.runs_plain(item):
            return reports
        cause = first_failure_line(reports)
        kept = self._set_aside(item, reports, saved)
        plain = run_plain(item, nextitem, tests)
        if not passed(plain):  # it fails anyway: the simulated run stands
            return self._restore(item, kept, item.stash.get(COMPUTING_BECAUSE, None))
        if not tests.opted_in(item):
            self.notes.append(
                f"{item.nodeid}: its memory was not simulated: it fails on the simulated "
                f"device ({cause}) and passes without it"
            )
            return plain
        reports = self._restore(item, kept, item.stash.get(COMPUTING_BECAUSE, None))
        fails_only_simulated(reports, cause)
        return reports

    def _within_budget(self, item: pytest.Item) -> bool:
        """Whether the guess's run that just failed stayed within its budget: computing with
        the whole budget would fail alike."""
        raised = self._tests.raised_in(item)
        return not (
            isinstance(raised, RunAgain) or (raised is not None and is_out_of_memory(raised))
        )

    def _set_aside(
        self, item: pytest.Item, reports: list[pytest.TestReport], saved: tuple[list, list]
    ) -> tuple[Any, ...]:
        """Keep the run that just ended (its reports, those held back, what it left on the
        item) and undo it, as :meth:`_forget` does."""
        sections = getattr(item, "_report_sections", None)
        kept = (
            reports,
            self._held,
            list(item.user_properties),
            list(sections) if isinstance(sections, list) else None,
            self._tests.set_aside(item),
        )
        self._held = []
        self._forget(item, saved)
        return kept

    def _restore(
        self, item: pytest.Item, kept: tuple[Any, ...], reason: str | None
    ) -> list[pytest.TestReport]:
        """Make the run set aside the one that stands; its reports."""
        reports, held, properties, sections, state = kept
        self._tests.restore(item, state)
        if COMPUTING_BECAUSE in item.stash:
            del item.stash[COMPUTING_BECAUSE]
        if reason is not None:
            item.stash[COMPUTING_BECAUSE] = reason
        item.stash[COMPUTING] = True
        item.stash[ON_A_GUESS] = False
        self._held = held
        item.user_properties[:] = properties
        if sections is not None and isinstance(getattr(item, "_report_sections", None), list):
            item._report_sections[:] = sections  # type: ignore[attr-defined]
        return reports

    def _mode_of(self, module: str) -> tuple[bool, bool]:
        """Whether a test of ``module`` computes, and whether on a guess."""
        if self.policy == "always" or module in self.computing:
            return True, False
        if module in self.guessed:
            return True, True
        if module in self.shape_only:
            return False, False
        # The file's first test: like the file before it.
        if self._last_computed:
            self.guessed.add(module)
            return True, True
        self.shape_only.add(module)
        return False, False

    def _run(
        self,
        item: pytest.Item,
        nextitem: pytest.Item | None,
        computing: bool,
        reason: str | None = None,
        *,
        guess: bool = False,
    ) -> list[pytest.TestReport]:
        item.stash[COMPUTING] = computing
        item.stash[ON_A_GUESS] = guess
        if reason is not None:
            item.stash[COMPUTING_BECAUSE] = reason
        self._remake_fixtures(item, computing)
        self._computing_now = computing
        if guess or not computing:
            item.stash[MAY_RUN_AGAIN] = "guess" if guess else "shape-only"
        # What an earlier run held back is the run's that this one replaces.
        self._held = []
        try:
            if computing:
                return runtestprotocol(item, nextitem=nextitem, log=False)
            with self.attempts.trying(item.nodeid):
                return runtestprotocol(item, nextitem=nextitem, log=False)
        finally:
            self._computing_now = None
            if MAY_RUN_AGAIN in item.stash:
                del item.stash[MAY_RUN_AGAIN]

    def _worth_another_mode(
        self, item: pytest.Item, reports: list[pytest.TestReport], *, guessed: bool = False
    ) -> bool:
        """Whether a run failed for a reason the other mode may not have: shape-only, for
        want of values; computing on a guess, past its budget or for any other reason. A
        memory verdict or a leak is the same in every mode, and so is the simulated device's
        out-of-memory; an xfail on a guess is the outcome computing gives, as plain does."""
        held_failed = guessed and any(r.failed for r in self._held)
        failed = any(r.failed for r in reports) or held_failed
        if not (failed if guessed else failed_or_xfailed(reports)):
            return False
        if held_failed:
            return True  # a subtest failed, which it may not in the other mode
        raised = self._tests.raised_in(item)
        if raised is None:
            # Nothing raised in setup or call: the memory verdict failed (a budget, a
            # regression), or teardown did.
            return any(r.failed for r in reports if r.when == "teardown")
        if isinstance(raised, LeakError):
            return False
        # A guess's out-of-memory is its budget's.
        return guessed or not is_out_of_memory(raised)

    def _forget(self, item: pytest.Item, saved: tuple[list[Any], list[Any]]) -> None:
        """Undo what the shape-only run left on the item and in the session's records."""
        self._tests.forget(item)
        if COMPUTING_BECAUSE in item.stash:
            del item.stash[COMPUTING_BECAUSE]
        item.user_properties[:] = saved[0]
        sections = getattr(item, "_report_sections", None)
        if isinstance(sections, list):
            sections[:] = saved[1]

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
        report = yield
        if call.excinfo is None or item.stash.get(MAY_RUN_AGAIN, None) != "shape-only":
            return report
        # What the test raised, where the session reports a shorter error in its stead.
        raised = self._tests.raised_in(item) or call.excinfo.value
        if run_again(item, raised):
            # A withdrawn attempt: what it left half-built on fake tensors (a DataLoader's
            # iterator that never started its workers) dies now, and what its __del__ raises
            # is the attempt's, not the test's.
            release_quietly(raised, call.excinfo.value)
        return report

    # -- fixtures of a broader scope ------------------------------------------------------

    @pytest.hookimpl(tryfirst=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: pytest.FixtureRequest) -> None:
        if self._computing_now is not None and fixturedef.scope != "function":
            self._made_in[fixturedef] = self._computing_now

    def _remake_fixtures(self, item: pytest.Item, computing: bool) -> None:
        """Tear down the broader-scoped fixtures of ``item`` made for the other mode; its setup
        makes them anew."""
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            return
        for name in getattr(item, "fixturenames", ()):
            definitions = info.name2fixturedefs.get(name)
            if not definitions:
                continue
            fixturedef = definitions[-1]
            made = self._made_in.get(fixturedef)
            if made is None or made == computing or fixturedef.cached_result is None:
                continue
            del self._made_in[fixturedef]
            # Its finalizers: the fixture's own teardown and those of fixtures using it. A
            # teardown error is of a value no test will see again.
            with contextlib.suppress(Exception):
                fixturedef.finish(types.SimpleNamespace(node=item))

    # -- remembering ----------------------------------------------------------------------

    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport):  # type: ignore[no-untyped-def]
        if not report.__dict__.pop(HELD_BACK, False):
            self._remember(report)
            return (yield)
        # A subtest of a run that may be run again: every plugin sees a passed setup, which
        # none shows or counts; the report itself is logged once the run is known to stand.
        when, outcome = report.when, report.outcome
        report.when, report.outcome = "setup", "passed"
        try:
            return (yield)
        finally:
            report.when, report.outcome = when, outcome
            self._held.append(report)

    def _remember(self, report: pytest.TestReport) -> None:
        module = getattr(report, _REPORT_ATTRIBUTE, None)
        if isinstance(module, str):
            self.found.add(module)
        module = getattr(report, _SHAPE_ONLY_ATTRIBUTE, None)
        if isinstance(module, str):
            self.found_shape_only.add(module)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        self.attempts.close()
        cache = getattr(self.config, "cache", None)
        if cache is None or hasattr(self.config, "workerinput"):
            return
        if self._xdist_controller:  # a worker that died in a test: the next run computes it
            self.attempts.look_for_crashes(starting=False)
        for key, remembered, found in (
            (NEEDS_VALUES_CACHE_KEY, self.remembered, self.found),
            (SHAPE_ONLY_CACHE_KEY, self.remembered_shape_only, self.found_shape_only),
        ):
            if not found <= remembered:
                cache.set(key, sorted(remembered | found))

    def pytest_terminal_summary(self, terminalreporter: Any) -> None:
        for note in [*self.attempts.notes, *self.notes]:
            terminalreporter.write_line(f"pytest-vram: {note}")

    def close(self) -> None:
        self.attempts.close()


def _files_in_cache(cache: Any, key: str) -> set[str]:
    """The test files pytest's cache lists under ``key``."""
    listed = cache.get(key, []) if cache is not None else []
    return {m for m in listed if isinstance(m, str)} if isinstance(listed, list) else set()
