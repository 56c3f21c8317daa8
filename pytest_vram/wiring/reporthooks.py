"""A measured test's reports: what the session puts on them, and the small plugins that read
them (a strict XPASS's failure, the records that ride from a pytest-xdist worker to its
controller).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

from pytest_vram.errors import VramWarning
from pytest_vram.record.record import TestRecord
from pytest_vram.record.status import Status
from pytest_vram.report import junit_properties
from pytest_vram.stash import IN_CALL, MEASUREMENT, PROPERTIES, RECORD, REPORTED_FAILED
from pytest_vram.verdict import Verdict

__all__ = [
    "ControllerReports",
    "FinalReports",
    "WorkerReports",
    "add_junit_properties",
    "failed_instead",
    "first_line_of",
    "warn_at_test",
    "with_late_sections",
]


def failed_instead(
    item: pytest.Item, call: pytest.CallInfo[None], message: str
) -> pytest.TestReport:
    """The report of ``call`` had it failed with ``message`` (pytest.fail, no traceback)."""
    try:
        # Not chained to the cause: the message stands for it, and says all.
        raise pytest.fail.Exception(message, pytrace=False) from None
    except pytest.fail.Exception:
        call.excinfo = pytest.ExceptionInfo.from_current()
    return pytest.TestReport.from_item_and_call(item, call)


def with_late_sections(item: pytest.Item, report: pytest.TestReport) -> pytest.TestReport:
    """The sections added to the test after pytest made its report (the allocator's state at
    an OOM, the snapshot's path) put on the report too."""
    for when, key, content in getattr(item, "_report_sections", ()):
        section = (f"Captured {key} {when}", content)
        if when == report.when and section not in report.sections:
            report.sections.append(section)
    return report


def add_junit_properties(item: pytest.Item, record: TestRecord) -> None:
    """Give ``item`` the JUnit properties of its ``record``: a rerun's replace the earlier
    run's (pytest-rerunfailures)."""
    earlier = item.stash.get(PROPERTIES, None)
    if earlier:
        item.user_properties[:] = [p for p in item.user_properties if p not in earlier]
    properties = item.stash[PROPERTIES] = list(junit_properties(record))
    item.user_properties.extend(properties)


def first_line_of(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def warn_at_test(item: pytest.Item, verdict: Verdict) -> Verdict:
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
    """On a pytest-xdist controller: collects the records that ride on the workers' reports
    into the session's ``records``, with their environments and notes; ``discard`` forgets an
    earlier run's record. A process that runs its own tests has no reports to read."""

    def __init__(
        self,
        records: list[TestRecord],
        environments: dict[str, dict[str, Any]],
        notes: list[str],
        discard: Callable[[TestRecord], None],
    ) -> None:
        self.records = records
        self.environments = environments
        self.notes = notes
        self.discard = discard
        #: The record collected for each test.
        self._collected: dict[str, TestRecord] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        data = getattr(report, "vram_record", None)
        if report.when != "teardown" or data is None:
            return
        record = TestRecord.from_dict(data)
        earlier = self._collected.get(record.nodeid)
        if earlier is not None:  # the test ran again on its worker: its last run is reported
            self.discard(earlier)
        self._collected[record.nodeid] = record
        self.records.append(record)
        environment = getattr(report, "vram_environment", None)
        if environment:
            self.environments.setdefault(record.backend, environment)
        for note in getattr(report, "vram_notes", ()):
            if note not in self.notes:
                self.notes.append(note)


class WorkerReports:
    """On a pytest-xdist worker: each record rides to the controller on its teardown report,
    whose ``pytest_runtest_logreport`` there hands it to the controller's session. The
    session's ``environments`` and its ``notes`` so far ride along."""

    def __init__(
        self, environments: dict[str, dict[str, Any]], notes: Callable[[], list[str]]
    ) -> None:
        self.environments = environments
        self.notes = notes

    @pytest.hookimpl(wrapper=True)
    def pytest_runtest_makereport(self, item: pytest.Item, call: pytest.CallInfo[None]):  # type: ignore[no-untyped-def]
        report = yield
        record = item.stash.get(RECORD, None)
        if call.when == "teardown" and record is not None:
            # Plain data: pytest-xdist serialises the report, attributes included.
            report.vram_record = record.to_dict()
            report.vram_environment = self.environments.get(record.backend, {})
            report.vram_notes = self.notes()
        return report
