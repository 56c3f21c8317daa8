"""The per-test record every report renders from.

A record is made on the process that ran the test and travels to the controller as a plain
dict on the teardown report (so pytest-xdist carries it unchanged); reports, baselines and the
JSON document are all computed from these dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_vram.attribution.breakdown import category_figures
from pytest_vram.status import Status, rank_of

__all__ = ["STATUS_ORDER", "BudgetResult", "TestRecord", "sort_worst_first"]

#: The status values worst first, for readers of plain data; :class:`Status` is the source.
STATUS_ORDER = tuple(status.value for status in Status)


@dataclass
class BudgetResult:
    limit: int
    metric: str
    peak: int | None
    #: The limit as the marker gave it (``"72GB"``), for messages.
    as_written: str
    passed: bool


@dataclass
class TestRecord:
    """What was measured for one test, in bytes."""

    __test__ = False  # not a test class, whatever pytest's name matching thinks

    nodeid: str
    backend: str
    device: str
    #: Peak allocated over setup and call, including what live fixtures hold.
    peak_allocated: int = 0
    #: Allocated when the test's setup began.
    start_allocated: int = 0
    #: Allocated after teardown (and garbage collection when something was left).
    end_allocated: int = 0
    peak_reserved: int | None = None
    peak_device: int | None = None
    counters: dict[str, int] = field(default_factory=dict)
    budgets: list[BudgetResult] = field(default_factory=list)
    #: Results of the vram scenarios the test ran: empty_cache, single_step, leak_check.
    scenarios: dict[str, Any] = field(default_factory=dict)
    #: Figures from the baseline store, when the test has an entry.
    baseline: dict[str, int] | None = None
    #: passed, failed or skipped: the test's own outcome.
    outcome: str = "passed"
    #: The memory verdict: a :class:`~pytest_vram.verdict.Status` value.
    status: str = "ok"
    messages: list[str] = field(default_factory=list)
    #: Under torchrun, on rank 0: each rank's figures (see :mod:`pytest_vram.distributed`);
    #: the figures above are then the maximum over ranks.
    ranks: list[dict[str, Any]] | None = None
    #: What was live at the peak, when it was broken down: ``total``, ``categories`` (bytes by
    #: parameters, gradients, optimizer, activations, temporaries, other) and ``modules``.
    breakdown: dict[str, Any] | None = None
    #: Under ``--vram-snapshot-on-fail``: the memory snapshot written for this failing test.
    snapshot: str | None = None

    @property
    def peak_increment(self) -> int:
        return self.peak_allocated - self.start_allocated

    @property
    def leftover(self) -> int:
        """Bytes the test left allocated: a leak signal."""
        return max(0, self.end_allocated - self.start_allocated)

    def figures(self) -> dict[str, int]:
        """The figures a baseline entry stores, by name."""
        if self.ranks:
            from pytest_vram.distributed import rank_figures

            return rank_figures(self.ranks)
        figures = {"peak_allocated": self.peak_allocated}
        if self.peak_reserved is not None:
            figures["peak_reserved"] = self.peak_reserved
        if self.peak_device is not None:
            figures["peak_device"] = self.peak_device
        if "empty_cache" in self.scenarios:
            figures["idle"] = self.scenarios["empty_cache"]["allocated"]
        if "single_step" in self.scenarios:
            figures["single_step_peak"] = self.scenarios["single_step"]["peak"]
        if "leak_check" in self.scenarios:
            figures["leak_growth"] = self.scenarios["leak_check"]["growth"]
        if self.breakdown:
            figures.update(category_figures(self.breakdown))
        return figures

    def to_dict(self) -> dict[str, Any]:
        # A shallow copy: dataclasses.asdict deep-copies, and this runs for every test.
        data = dict(vars(self))
        data["budgets"] = [vars(budget).copy() for budget in self.budgets]
        data["peak_increment"] = self.peak_increment
        data["leftover"] = self.leftover
        if self.ranks is None:  # a single process's record reads as before
            del data["ranks"]
        if self.snapshot is None:  # as do the records of tests without a snapshot
            del data["snapshot"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TestRecord:
        known = {name for name in cls.__dataclass_fields__}
        values = {key: value for key, value in data.items() if key in known}
        values["budgets"] = [BudgetResult(**b) for b in values.get("budgets", [])]
        return cls(**values)


def sort_worst_first(records: list[TestRecord]) -> list[TestRecord]:
    """Worst status first (see :class:`Status`), then by peak, largest first."""
    return sorted(records, key=lambda r: (rank_of(r.status), -r.peak_allocated))
