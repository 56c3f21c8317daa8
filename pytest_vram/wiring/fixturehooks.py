"""Fixtures of a broader scope (class, module, session) under measurement: made in a measured
test's setup, what they hold counts as the test's only once made, as in a later test that finds
them made; ended, what they held may be old garbage.

Registered only once a measured test has such fixtures: most suites' fixture setups then pay
nothing for this plugin.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from pytest_vram.garbage import OLD_GARBAGE
from pytest_vram.measure.measurement import TestMeasurement

__all__ = ["BROADER_FIXTURES_NAME", "BroaderFixtures"]

BROADER_FIXTURES_NAME = "vram-broader-fixtures"


class BroaderFixtures:
    """The fixture hooks of a session whose measured tests have broader-scoped fixtures;
    ``current`` gives the measurement of the test being set up or run, None between tests."""

    def __init__(self, current: Callable[[], TestMeasurement | None]) -> None:
        self.current = current
        #: Per broader-scoped fixture being made or made: OLD_GARBAGE.freezes then.
        self._made: dict[Any, int] = {}

    @pytest.hookimpl(wrapper=True)
    def pytest_fixture_setup(self, fixturedef: Any, request: pytest.FixtureRequest):  # type: ignore[no-untyped-def]
        if fixturedef.scope == "function":
            return (yield)
        self._made[fixturedef] = OLD_GARBAGE.freezes
        measurement = self.current()
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
