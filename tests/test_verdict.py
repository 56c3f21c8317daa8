"""The judge: (record, marks, baseline entry, settings, outcome) -> verdict, without pytest runs."""

from __future__ import annotations

from typing import Any

import pytest
from plain_settings import SETTINGS, settings

from pytest_vram.marks import Budget, VramMarks
from pytest_vram.record.record import TestRecord
from pytest_vram.record.status import FAILING_STATUSES, Status, rank_of
from pytest_vram.units import parse_tolerance
from pytest_vram.verdict import Outcome, judge

MiB = 1024**2


def record(peak: int = 10 * MiB, **fields: Any) -> TestRecord:
    return TestRecord(
        nodeid="t.py::test", backend="sim", device="sim", peak_allocated=peak, **fields
    )


def budget(limit: int, metric: str = "allocated") -> VramMarks:
    return VramMarks(budgets=(Budget(limit, metric, limit),))


def test_statuses_are_listed_worst_first_and_know_whether_they_fail() -> None:
    assert [status.rank for status in Status] == list(range(len(Status)))
    assert Status.OOM.rank < Status.REGRESSION.rank < Status.NEW.rank < Status.OK.rank
    assert {s.value for s in Status if s.fails} == FAILING_STATUSES
    assert not Status.NEW.fails and not Status.IMPROVED.fails and not Status.SKIPPED.fails
    assert Status.OK.stored and Status.NEW.stored and Status.IMPROVED.stored
    assert not Status.LEAK.stored and not Status.OVER_BUDGET.stored and not Status.OOM.stored
    assert Status.REGRESSION.stored  # what --vram-update-baselines is for
    assert not Status.SKIPPED.stored
    assert rank_of("regression") == Status.REGRESSION.rank
    assert rank_of("from a newer plugin") == len(Status)
    for status in Status:  # by value or as the member
        assert rank_of(status.value) == rank_of(status) == status.rank
    assert rank_of(["ok"]) == len(Status)  # not even hashable


def test_no_entry_is_new_and_passes() -> None:
    verdict = judge(record(), VramMarks(), None, SETTINGS)
    assert verdict.status is Status.NEW
    assert verdict.failures == []


def test_no_entry_fails_under_strict_naming_the_update_command() -> None:
    verdict = judge(record(), VramMarks(), None, settings(strict=True))
    assert verdict.status is Status.FAILED
    assert "pytest --vram-update-baselines t.py::test" in verdict.failures[0]


def test_growth_within_tolerance_is_ok() -> None:
    verdict = judge(record(peak=10 * MiB), VramMarks(), {"peak_allocated": 10 * MiB - 1}, SETTINGS)
    assert verdict.status is Status.OK
    assert verdict.baseline == {"peak_allocated": 10 * MiB - 1}


def test_growth_beyond_tolerance_is_a_regression_with_both_numbers() -> None:
    verdict = judge(record(peak=12 * MiB), VramMarks(), {"peak_allocated": 10 * MiB}, SETTINGS)
    assert verdict.status is Status.REGRESSION
    assert verdict.status.fails
    assert "12.00 MiB" in verdict.failures[0] and "10.00 MiB" in verdict.failures[0]
    assert "+20.0%" in verdict.failures[0]


def test_the_marker_tolerance_beats_the_settings() -> None:
    marks = VramMarks(tolerance=parse_tolerance("25%"))
    verdict = judge(record(peak=12 * MiB), marks, {"peak_allocated": 10 * MiB}, SETTINGS)
    assert verdict.status is Status.OK


def test_shrinking_beyond_tolerance_is_improved_and_passes() -> None:
    verdict = judge(record(peak=5 * MiB), VramMarks(), {"peak_allocated": 10 * MiB}, SETTINGS)
    assert verdict.status is Status.IMPROVED
    assert verdict.failures == []
    assert verdict.notes[0].startswith("improved:")


def test_a_budget_over_its_limit_fails_with_the_limit_the_peak_and_the_excess() -> None:
    verdict = judge(record(peak=3 * MiB), budget(2 * MiB), {"peak_allocated": 3 * MiB}, SETTINGS)
    assert verdict.status is Status.OVER_BUDGET
    assert verdict.failures == [
        "peak allocated memory 3.00 MiB exceeds max_vram(2.00 MiB) by 1.00 MiB"
    ]
    assert [b.passed for b in verdict.budgets] == [False]


def test_the_worst_status_wins_whatever_is_found_first() -> None:
    # Over budget and regressed: over-budget ranks worse.
    verdict = judge(record(peak=30 * MiB), budget(MiB), {"peak_allocated": MiB}, SETTINGS)
    assert verdict.status is Status.OVER_BUDGET
    assert len(verdict.failures) == 3  # the budget, the regression and the update hint
    # An OOM beats a budget that the peak before it already crossed.
    oom = judge(record(peak=30 * MiB), budget(MiB), None, SETTINGS, Outcome.OUT_OF_MEMORY)
    assert oom.status is Status.OOM


def test_a_failed_test_is_not_compared_with_its_baseline() -> None:
    verdict = judge(
        record(peak=30 * MiB), VramMarks(), {"peak_allocated": MiB}, SETTINGS, Outcome.FAILED
    )
    assert verdict.status is Status.FAILED
    assert verdict.failures == []  # the test's own error is the message


def test_a_leak_keeps_its_message() -> None:
    verdict = judge(
        record(), VramMarks(), None, SETTINGS, Outcome.LEAKED, error="leak check failed: +1 KiB"
    )
    assert verdict.status is Status.LEAK
    assert verdict.failures == ["leak check failed: +1 KiB"]


def test_updating_baselines_compares_nothing_but_budgets_still_fail() -> None:
    update = settings(update_baselines=True)
    assert judge(record(peak=30 * MiB), VramMarks(), {"peak_allocated": MiB}, update).status is (
        Status.OK
    )
    assert judge(record(peak=3 * MiB), budget(MiB), None, update).status is Status.OVER_BUDGET


def test_skipped_is_skipped() -> None:
    verdict = judge(record(), budget(1), {"peak_allocated": 1}, SETTINGS, Outcome.SKIPPED)
    assert verdict.status is Status.SKIPPED
    assert verdict.failures == [] and verdict.budgets == []


@pytest.mark.parametrize("metric", ["reserved", "device"])
def test_a_metric_the_backend_cannot_measure_is_not_checked_and_passes(metric: str) -> None:
    verdict = judge(
        record(), budget(1, metric), None, SETTINGS, unmeasured={"device": "no NVML here"}
    )
    assert verdict.status is Status.NEW
    assert f"metric={metric!r}) not checked" in verdict.notes[0]
    if metric == "device":
        assert "no NVML here" in verdict.notes[0]
    assert [b.peak for b in verdict.budgets] == [None]


def test_a_metric_the_backend_cannot_measure_fails_under_strict() -> None:
    verdict = judge(record(), budget(1, "device"), None, settings(strict=True))
    assert verdict.status is Status.OVER_BUDGET
    assert "not checked" in verdict.failures[0] and "--vram-strict" in verdict.failures[0]


def test_a_test_that_is_not_gated_is_neither_compared_nor_held_to_strict() -> None:
    entry = {"peak_allocated": 1 * MiB}
    verdict = judge(record(100 * MiB), VramMarks(), entry, settings(strict=True), gated=False)
    assert verdict.status is Status.UNGATED
    assert (verdict.failures, verdict.baseline) == ([], None)
    assert not Status.UNGATED.fails and not Status.UNGATED.stored
    failed = judge(record(), VramMarks(), None, SETTINGS, Outcome.FAILED, gated=False)
    assert failed.status is Status.FAILED


def test_a_change_within_the_floor_is_neither_a_regression_nor_an_improvement() -> None:
    entry = {"peak_allocated": 10 * MiB}
    assert judge(record(10 * MiB + MiB // 2), VramMarks(), entry, SETTINGS, floor=MiB).status is (
        Status.OK
    )
    assert judge(record(9 * MiB), VramMarks(), entry, SETTINGS, floor=2 * MiB).status is Status.OK
    grown = judge(record(12 * MiB), VramMarks(), entry, SETTINGS, floor=MiB)
    assert grown.status is Status.REGRESSION
    # A count has no size: any loss fails, floor or not.
    counted = judge(
        record(10 * MiB, scenarios={"max_size": {"value": 3}}),
        VramMarks(),
        {**entry, "max_size": 4},
        SETTINGS,
        floor=MiB,
    )
    assert counted.status is Status.REGRESSION


def test_a_budget_failure_gives_the_peak_in_totals_where_the_baseline_did_not_move() -> None:
    categories = {"parameters": 6 * MiB, "activations": 4 * MiB}
    entry = {"peak_allocated": 10 * MiB, "peak_parameters": 6 * MiB, "peak_activations": 4 * MiB}
    verdict = judge(record(categories=categories), budget(8 * MiB), entry, SETTINGS)
    assert verdict.status is Status.OVER_BUDGET
    assert verdict.failures[1] == (
        "at the peak: parameters 6.00 MiB, activations 4.00 MiB; against the baseline: "
        "parameters, activations unchanged"
    )
