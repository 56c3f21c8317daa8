"""The memory verdict of one test: a :class:`~pytest_vram.record.status.Status` and the
messages that explain it.

:func:`judge` is pure: it reads a finished record, the test's marks, its baseline entry and the
settings, and returns a :class:`Verdict`. Nothing else decides a status.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pytest_vram.attribution.breakdown import (
    describe_breakdown,
    describe_growth,
    entry_categories,
)
from pytest_vram.baselines.compare import FigureChange, compare_with_entry, unmeasured_figures
from pytest_vram.record.figures import figure_unit
from pytest_vram.record.record import BudgetResult, TestRecord
from pytest_vram.record.status import Status
from pytest_vram.units import describe_size, format_size

if TYPE_CHECKING:
    from pytest_vram.marks import VramMarks
    from pytest_vram.options import Settings

__all__ = ["Outcome", "Verdict", "judge"]


class Outcome(str, enum.Enum):
    """How the test's setup and call ended, as far as memory is concerned."""

    PASSED = "passed"
    FAILED = "failed"
    OUT_OF_MEMORY = "oom"
    LEAKED = "leak"
    SKIPPED = "skipped"


@dataclass(frozen=True)
class Verdict:
    """The memory verdict of one test: made whole by :func:`judge`, never changed after
    (``dataclasses.replace`` makes a changed copy)."""

    status: Status
    #: Why the test fails, one reason a line; empty when it passes.
    failures: list[str] = field(default_factory=list)
    #: What a passing test's report should say (an improvement, a figure not checked).
    notes: list[str] = field(default_factory=list)
    budgets: list[BudgetResult] = field(default_factory=list)
    #: The baseline entry the test was compared with.
    baseline: dict[str, int] | None = None
    #: The notes that are warnings (:class:`~pytest_vram.errors.VramWarning`): a figure
    #: that was not checked.
    warnings: list[str] = field(default_factory=list)


def judge(
    record: TestRecord,
    marks: VramMarks,
    entry: Mapping[str, int] | None,
    settings: Settings,
    outcome: Outcome = Outcome.PASSED,
    *,
    error: str | None = None,
    unmeasured: Mapping[str, str] | None = None,
    gated: bool = True,
    floor: int = 0,
) -> Verdict:
    """Judge a finished test: its budgets, then (when it passed) its baseline.

    ``outcome`` is how the test ended and ``error`` the first line of what it raised (an OOM
    or a leak check's message). ``unmeasured`` says, per metric this backend cannot measure,
    why. A test that is not ``gated`` (it did not opt in) is never compared, stored or held to
    --vram-strict; a gated test that did not opt in fails only for a change of more than
    ``floor`` bytes. The status is the worst of everything found.
    """
    if outcome is Outcome.SKIPPED:
        return Verdict(Status.SKIPPED)
    if not gated:
        return Verdict(_OUTCOME_STATUS.get(outcome, Status.UNGATED))
    if outcome is Outcome.PASSED and not marks.budgets and entry is None and not settings.strict:
        # Most tests of a suite without baselines: nothing to check, and nothing to say.
        return Verdict(Status.OK if settings.update_baselines else Status.NEW)
    found: list[Status] = []
    failures: list[str] = []
    notes: list[str] = []
    unchecked: list[str] = []
    if outcome is Outcome.OUT_OF_MEMORY:
        found.append(Status.OOM)
    elif outcome is Outcome.LEAKED:
        found.append(Status.LEAK)
    elif outcome is Outcome.FAILED:
        found.append(Status.FAILED)
    if error and outcome in (Outcome.OUT_OF_MEMORY, Outcome.LEAKED):
        failures.append(error)
    budgets = _check_budgets(record, marks, settings, found, failures, unchecked, unmeasured or {})
    notes += unchecked
    baseline = None
    if outcome is Outcome.PASSED and not settings.update_baselines:
        baseline = _compare(record, marks, entry, settings, found, failures, notes, floor)
    status = min(found, key=lambda status: status.rank, default=Status.OK)
    grew = Status.OVER_BUDGET in found or any(
        line.startswith("memory regression") for line in failures
    )
    if grew and _categories(record) is not None:
        over_budget = Status.OVER_BUDGET in found
        failures.insert(_last_figure_line(failures), _where(record, entry, over_budget))
    return Verdict(status, failures, notes, budgets, baseline, warnings=unchecked)


# How a test that is not gated ended: its own failure, never its memory's.
_OUTCOME_STATUS = {
    Outcome.FAILED: Status.FAILED,
    Outcome.OUT_OF_MEMORY: Status.OOM,
    Outcome.LEAKED: Status.LEAK,
}


def _last_figure_line(failures: list[str]) -> int:
    """Where the breakdown goes: after the figures, before the hint to update the baseline."""
    if failures and failures[-1].startswith("if this is intended"):
        return len(failures) - 1
    return len(failures)


def _where(record: TestRecord, entry: Mapping[str, int] | None, over_budget: bool) -> str:
    """What the peak was made of, against the baseline's categories where it has them; a
    budget's excess is told in totals first, since the baseline may not have moved."""
    current = _categories(record) or {}
    stored = entry_categories(entry)
    if stored is not None:
        growth = describe_growth(current, stored)
        if over_budget:
            totals = describe_breakdown(record.breakdown or {"categories": current})
            return f"at the peak: {totals}; against the baseline: {growth}"
        return f"at the peak, against the baseline: {growth}"
    # The modules too, under --vram-breakdown.
    return f"at the peak: {describe_breakdown(record.breakdown or {'categories': current})}"


def _categories(record: TestRecord) -> dict[str, int] | None:
    """The category totals at the record's peak: recorded on their own, or a breakdown's."""
    if record.categories is not None:
        return record.categories
    return (record.breakdown or {}).get("categories")


def _check_budgets(
    record: TestRecord,
    marks: VramMarks,
    settings: Settings,
    found: list[Status],
    failures: list[str],
    unchecked: list[str],
    unmeasured: Mapping[str, str],
) -> list[BudgetResult]:
    peaks = {
        "allocated": record.peak_allocated,
        "reserved": record.peak_reserved,
        "device": record.peak_device,
    }
    results = []
    for budget in marks.budgets:
        peak = peaks[budget.metric]
        shown = describe_size(budget.as_written)
        if peak is None:
            why = unmeasured.get(budget.metric)
            message = (
                f"max_vram({shown}, metric={budget.metric!r}) not checked: the "
                f"{record.backend} backend does not measure {budget.metric} memory"
                + (f" ({why})" if why else "")
            )
            if settings.strict:
                found.append(Status.OVER_BUDGET)
                failures.append(message + " (--vram-strict)")
            else:
                unchecked.append(message)
            passed = not settings.strict
        else:
            passed = peak <= budget.limit
            if not passed:
                found.append(Status.OVER_BUDGET)
                failures.append(
                    f"peak {budget.metric} memory {format_size(peak)} exceeds "
                    f"max_vram({shown}) by {format_size(peak - budget.limit)}"
                )
        results.append(
            BudgetResult(budget.limit, budget.metric, peak, str(budget.as_written), passed)
        )
    return results


def _compare(
    record: TestRecord,
    marks: VramMarks,
    entry: Mapping[str, int] | None,
    settings: Settings,
    found: list[Status],
    failures: list[str],
    notes: list[str],
    floor: int = 0,
) -> dict[str, int] | None:
    """Compare the record's figures with its baseline ``entry``; the entry compared with.

    A change in bytes of ``floor`` or less is neither a regression nor an improvement."""
    update = f"pytest --vram-update-baselines {record.nodeid}"
    if entry is None:
        found.append(Status.NEW)
        if settings.strict:
            found.append(Status.FAILED)
            failures.append(
                f"no baseline for {record.nodeid} on device {record.device!r} in "
                f"{settings.baseline_dir} (--vram-strict); record one with {update}"
            )
        return None
    baseline = dict(entry)
    tolerance = marks.tolerance or settings.tolerance
    current = record.figures()
    changes = compare_with_entry(current, baseline, tolerance)
    if floor:
        changes = [change for change in changes if change.beyond(floor)]
    hint = f"if this is intended, update the baseline: {update}"
    regressions = [change for change in changes if change.regressed]
    improvements = [change for change in changes if change.improved]
    # A stored figure this run did not measure (a scenario the test no longer runs, a rank
    # that no longer reports) would otherwise pass unchecked.
    missing = {
        name: value
        for name, value in unmeasured_figures(current, baseline).items()
        if name not in record.unstored  # measured, and never stored on this backend
    }
    if regressions or missing:
        found.append(Status.REGRESSION)
        failures += [f"memory regression: {_describe(c, record)}" for c in regressions]
        failures += [
            f"the baseline stores {name} = {_stored_value(name, value)} and this run did not "
            "measure it"
            for name, value in missing.items()
        ]
        failures.append(hint)
    elif improvements:
        found.append(Status.IMPROVED)
        notes += [f"improved: {_describe(c, record)}" for c in improvements]
        notes.append(hint)
    return baseline


def _stored_value(name: str, value: int) -> str:
    return str(value) if figure_unit(name) == "count" else format_size(value)


def _describe(change: FigureChange, record: TestRecord) -> str:
    """A change as a message says it; the largest size that fits with its capacity and the
    peaks either side of it: ``largest batch that fits 80 GB: 12 -> 10 (at 10: ...)``."""
    found = record.scenarios.get("max_size") if change.figure == "max_size" else None
    if not isinstance(found, dict):
        return change.describe()
    # Here, not at the top: the fit package's face loads its search, which few runs need.
    from pytest_vram.fit.wording import at

    return (
        f"largest {found.get('knob', 'size')} that fits {found.get('capacity_text', '?')}: "
        f"{change.baseline} -> {change.current} ({at(found)})"
    )
