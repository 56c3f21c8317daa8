"""What the plugin keeps on a test item (``item.stash``), in one place: the keys its pieces share.

The selection sets the first ones when a test is collected, the session those of each run;
values on demand keeps its own (:mod:`pytest_vram.backends.sim.ondemand`). A key holds state
for one item; nothing here decides anything.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_vram.marks import MarkerError, VramMarks
    from pytest_vram.measure.measurement import TestMeasurement
    from pytest_vram.record.record import TestRecord

__all__ = [
    "IN_CALL",
    "MARKER_ERROR",
    "MARKS",
    "MEASUREMENT",
    "OPTED_IN",
    "PROPERTIES",
    "RECORD",
    "REPORTED_FAILED",
    "SUBTEST_ERRORS",
]

# -- set at collection ------------------------------------------------------------------------

#: Set on the tests that are measured: their parsed markers.
MARKS: pytest.StashKey[VramMarks] = pytest.StashKey()
#: Set on the tests that are measured: whether the test opted in (a vram marker or fixture).
#: Only those are compared with baselines, stored and held to --vram-strict, unless every
#: measured test is gated (--vram-gate=all).
OPTED_IN: pytest.StashKey[bool] = pytest.StashKey()
#: Set on a test whose vram markers are malformed; its setup reports the error.
MARKER_ERROR: pytest.StashKey[MarkerError] = pytest.StashKey()

# -- set by the session, per run of a test ------------------------------------------------------

#: Set on a measured test while it runs: what the vram fixture hands the test.
MEASUREMENT: pytest.StashKey[TestMeasurement] = pytest.StashKey()
#: Set on a measured test after its teardown: its finished record.
RECORD: pytest.StashKey[TestRecord] = pytest.StashKey()
#: Set on a measured test while its call runs: a report made then is a subtest's.
IN_CALL: pytest.StashKey[bool] = pytest.StashKey()
#: Set on a measured test one of whose subtests failed in this run: what they raised.
SUBTEST_ERRORS: pytest.StashKey[list[BaseException]] = pytest.StashKey()
#: Set on a measured test whose setup or call pytest reported failed (a strict XPASS too).
REPORTED_FAILED: pytest.StashKey[bool] = pytest.StashKey()
#: The JUnit properties the last run of a test added: a rerun's replace them.
PROPERTIES: pytest.StashKey[list[tuple[str, object]]] = pytest.StashKey()
