"""pytest-benchmark integration: a measured test's memory in its benchmark, and rounds that
start clean.

When a measured test uses pytest-benchmark's ``benchmark`` fixture:

- its figures go into ``benchmark.extra_info`` at teardown (``vram_peak_allocated``,
  ``vram_backend``, ``vram_device``, ``vram_status``... as in the JUnit properties, plus the
  worst single run's ``vram_round_peak`` and ``vram_round_increment``), so that
  ``--benchmark-json``, ``--benchmark-autosave`` and ``pytest-benchmark compare`` carry them.
  pytest-benchmark writes ``extra_info`` at the end of the session, so they are final there.
- every run of the benchmarked function (calibration, warm-up and timed rounds: each call of
  pytest-benchmark's runner) starts from a released allocator cache, and what a run left
  collectable is collected after it. Both happen outside the timed region, which pytest-benchmark
  takes inside its runner, so the timings do not include them.

pytest-benchmark is not imported: the fixture object is used through the two things every
release has, ``extra_info`` and ``_make_runner``.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from typing import Any

import pytest

from pytest_vram.measure.measurement import TestMeasurement
from pytest_vram.record.record import TestRecord
from pytest_vram.stash import MEASUREMENT

__all__ = ["PLUGIN_NAME", "BenchmarkMemory", "BenchmarkRounds", "register"]

#: The plugin's name: ``-p no:vram-benchmark`` turns the integration off.
PLUGIN_NAME = "vram-benchmark"
ROUNDS = pytest.StashKey["BenchmarkRounds"]()


def register(config: pytest.Config) -> None:
    """Register the integration where pytest-benchmark is active."""
    manager = config.pluginmanager
    if manager.hasplugin("benchmark") and manager.get_plugin(PLUGIN_NAME) is None:
        manager.register(BenchmarkMemory(), PLUGIN_NAME)


class BenchmarkRounds:
    """Wraps a benchmark fixture's runner so that each run starts clean and is measured."""

    def __init__(self, measurement: TestMeasurement, fixture: Any) -> None:
        self.measurement = measurement
        self.fixture = fixture
        self.backend = measurement.backend
        #: Runner calls: calibration, warm-up and timed rounds.
        self.runs = 0
        #: The highest peak allocated over one run, and over one run above its start.
        self.round_peak = 0
        self.round_increment = 0
        #: What the test held before the first run: more than that after a run is collected.
        self._floor: int | None = None
        self._last_after: int | None = None
        # On cuda, keep cuBLAS's workspaces between rounds: freeing them would put a new
        # workspace's allocation into each round's timing.
        self._release: Callable[[], None] = self.backend.release_blocks
        original = fixture._make_runner

        def make_runner(function: Any, args: Any, kwargs: Any) -> Callable[..., Any]:
            return self._wrap(original(function, args, kwargs))

        fixture._make_runner = make_runner

    def _wrap(self, runner: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self._before()
            window = self.measurement.open_window()
            start = window.allocated
            try:
                return runner(*args, **kwargs)  # pytest-benchmark's timer starts in here
            finally:
                self.measurement.close_window(window)
                self.runs += 1
                self.round_peak = max(self.round_peak, window.allocated)
                self.round_increment = max(self.round_increment, window.allocated - start)
                self._after()

        return run

    def _before(self) -> None:
        backend = self.backend
        if self._floor is None:
            self._floor = backend.allocated()
        reserved = backend.reserved()
        # Nothing cached, nothing to release (and on cuda no synchronisation to pay for).
        if reserved is None or reserved > backend.allocated():
            self._release()

    def _after(self) -> None:
        now = self.backend.allocated()
        if self._floor is not None and now > self._floor:
            # What one run leaves is young: collecting the young generations costs
            # microseconds where a full collection costs tens of milliseconds.
            gc.collect(1)
            now = self.backend.allocated()
            if self._last_after is not None and now > self._last_after:
                # Still growing run over run: garbage that got old enough to outlive that.
                gc.collect()
                now = self.backend.allocated()
        self._last_after = now

    def write(self, record: TestRecord) -> None:
        """Put the test's figures into the benchmark's ``extra_info``."""
        info = self.extra_info(record)
        # The stats pytest-benchmark saves hold the dict the fixture had when the benchmark
        # ran; a test may have replaced the fixture's since.
        stats = getattr(self.fixture, "stats", None)
        targets = (self.fixture.extra_info, getattr(stats, "extra_info", None))
        for target in {id(t): t for t in targets if isinstance(t, dict)}.values():
            target.update(info)

    def extra_info(self, record: TestRecord) -> dict[str, Any]:
        """The figures a benchmark carries: sizes in integer bytes."""
        from pytest_vram.report.junit import junit_properties

        info: dict[str, Any] = dict(junit_properties(record))
        info["vram_round_peak"] = self.round_peak
        info["vram_round_increment"] = self.round_increment
        info["vram_runs"] = self.runs
        return info


class BenchmarkMemory:
    """The pytest plugin: finds the benchmark fixture of a measured test, fills its
    ``extra_info`` once the test's figures are final."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtestloop(self, session: pytest.Session) -> None:
        # Without a test that uses the benchmark fixture, the other tests pay nothing for
        # this plugin's hooks. (An xdist controller collects nothing: pytest 7 gives its
        # session no ``items``.)
        items = getattr(session, "items", ())
        if any("benchmark" in getattr(item, "fixturenames", ()) for item in items):
            return
        session.config.pluginmanager.unregister(self)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_call(self, item: pytest.Item):  # type: ignore[no-untyped-def]
        measurement = item.stash.get(MEASUREMENT, None)
        if measurement is not None:
            fixture = getattr(item, "funcargs", {}).get("benchmark")
            if isinstance(getattr(fixture, "extra_info", None), dict) and callable(
                getattr(fixture, "_make_runner", None)
            ):
                item.stash[ROUNDS] = BenchmarkRounds(measurement, fixture)
        return (yield)

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
        report = yield
        rounds = item.stash.get(ROUNDS, None)
        # After teardown: the session has finished the record (leftover, status) by now.
        if call.when == "teardown" and rounds is not None:
            rounds.write(rounds.measurement.record)
        return report
