"""The per-test record every report renders from.

A record is made on the process that ran the test and travels to the controller as a plain
dict on the teardown report (so pytest-xdist carries it unchanged); reports, baselines and the
JSON document are all computed from these dicts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pytest_vram.record.figures import (
    FigureError,
    check_breakdown,
    check_categories,
    check_entry,
    check_figure,
    check_nodeid,
    check_rank_entries,
    check_scenarios,
    check_text,
    rank_figures,
    stored_figures,
)
from pytest_vram.record.status import Status, rank_of

__all__ = ["STATUS_ORDER", "BudgetResult", "TestRecord", "read_record", "sort_worst_first"]

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
    #: Results of the vram scenarios the test ran: empty_cache, single_step, leak_check,
    #: max_size.
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
    #: The category totals at the peak (bytes by category), on every backend whose allocations
    #: a tracker sees (sim, cpu), and under ``--vram-breakdown``; None where not recorded.
    categories: dict[str, int] | None = None
    #: Under ``--vram-snapshot-on-fail``: the memory snapshot written for this failing test.
    snapshot: str | None = None
    #: Figures measured but never stored: the backend's reading of them depends on what other
    #: tests hold (see ``Backend.order_dependent_figures``).
    unstored: list[str] = field(default_factory=list)
    #: Under torchrun, on rank 0: the ranks whose record never came. Such a record is not
    #: stored: its figures are not the maximum over every rank.
    missing_ranks: list[int] = field(default_factory=list)
    #: For a test that failed or regressed, where the lines were taken (a rerun of the test):
    #: the lines of the user's code that allocated what was alive at the peak, largest first,
    #: each ``file``, ``line``, ``text``, ``bytes`` and ``category``; None where not taken.
    peak_lines: list[dict[str, Any]] | None = None

    @property
    def peak_increment(self) -> int:
        return self.peak_allocated - self.start_allocated

    @property
    def leftover(self) -> int:
        """Bytes the test left allocated: a leak signal."""
        return max(0, self.end_allocated - self.start_allocated)

    def figures(self) -> dict[str, int]:
        """The figures a baseline entry stores, by name (see :mod:`pytest_vram.record.figures`)."""
        if self.ranks:
            return rank_figures(self.ranks)
        figures = stored_figures(
            self.peak_allocated,
            self.peak_reserved,
            self.peak_device,
            self.scenarios,
            {"categories": self.categories} if self.categories is not None else self.breakdown,
        )
        for name in self.unstored:
            figures.pop(name, None)
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
        if not self.unstored:
            del data["unstored"]
        if not self.missing_ranks:
            del data["missing_ranks"]
        if self.categories is None:  # a cuda test's record reads as before
            del data["categories"]
        if self.peak_lines is None:  # as does every test whose lines were not taken
            del data["peak_lines"]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TestRecord:
        known = {name for name in cls.__dataclass_fields__}
        values = {key: value for key, value in data.items() if key in known}
        values["budgets"] = [BudgetResult(**b) for b in values.get("budgets", [])]
        return cls(**values)


def read_record(data: object) -> TestRecord:
    """A record read back from outside the process, such as a ``--vram-json`` document's.

    Built as :meth:`TestRecord.from_dict` builds it, then every field a baseline stores is
    checked as the baseline loader checks it, so what is merged into a baseline file is what
    the next run reads. Raises FigureError naming the field (``scenarios.leak_check.growth``)
    and its value; TypeError, KeyError or AttributeError for data that is no record at all.
    """
    if not isinstance(data, dict):
        raise TypeError(f"expected an object, got {type(data).__name__}")
    record = TestRecord.from_dict(data)
    check_nodeid(record.nodeid)
    check_text("backend", record.backend)
    check_text("device", record.device)
    for name in ("peak_allocated", "start_allocated", "end_allocated"):
        check_figure(name, getattr(record, name))
    for name in ("peak_reserved", "peak_device"):
        if getattr(record, name) is not None:
            check_figure(name, getattr(record, name))
    check_scenarios(record.scenarios)
    if record.breakdown is not None:
        check_breakdown(record.breakdown)
    if record.categories is not None:
        check_categories(record.categories)
    if record.ranks is not None:
        check_rank_entries(record.ranks)
    if record.peak_lines is not None:
        _check_peak_lines(record.peak_lines)
    # What an update would store, checked as a whole as the loader checks an entry.
    check_entry(record.nodeid, record.figures())
    return record


def _check_peak_lines(lines: object) -> None:
    """A record's peak lines: a list of objects, each with its bytes a figure."""
    if not isinstance(lines, list):
        raise FigureError(f"peak_lines must be a list, got {type(lines).__name__}")
    for index, entry in enumerate(lines):
        if not isinstance(entry, dict):
            raise FigureError(f"peak_lines[{index}] must be an object")
        check_figure(f"peak_lines[{index}].bytes", entry.get("bytes"))
        for key in ("file", "text", "category"):
            if not isinstance(entry.get(key, ""), str):
                raise FigureError(f"peak_lines[{index}].{key} must be text")
        line = entry.get("line")
        if isinstance(line, bool) or not isinstance(line, int):
            raise FigureError(f"peak_lines[{index}].line must be an integer")


def sort_worst_first(records: list[TestRecord]) -> list[TestRecord]:
    """Worst status first (see :class:`Status`), then by peak, largest first."""
    return sorted(records, key=lambda r: (rank_of(r.status), -r.peak_allocated))
