"""A test's memory status, worst first: the one order every report and the judge use."""

from __future__ import annotations

import enum

__all__ = ["FAILING_STATUSES", "Status", "is_stored", "rank_of"]


class Status(str, enum.Enum):
    """A test's memory status. Members are listed worst first: the order of every report."""

    OOM = "oom"
    OVER_BUDGET = "over-budget"
    LEAK = "leak"
    REGRESSION = "regression"
    FAILED = "failed"
    NEW = "new"
    IMPROVED = "improved"
    OK = "ok"
    #: Measured and reported, never compared or stored: the test did not opt in (a vram
    #: marker or fixture) and not every test is gated.
    UNGATED = "ungated"
    SKIPPED = "skipped"

    def __str__(self) -> str:
        return self.value

    @property
    def rank(self) -> int:
        """0 for the worst status; reports sort by it."""
        return _RANK[self]

    @property
    def fails(self) -> bool:
        """Whether the test fails because of (or with) this status."""
        return self in _FAILING

    @property
    def stored(self) -> bool:
        """Whether ``--vram-update-baselines`` may store the figures of a test with this
        status: a test that failed or whose memory check failed (a budget, a leak, an OOM)
        must not become the new normal, and a skipped test measured nothing. A regression is
        what an update is for."""
        return self not in _NOT_STORED


_RANK = {status: index for index, status in enumerate(Status)}
_RANK_BY_VALUE = {status.value: index for status, index in _RANK.items()}
_FAILING = frozenset(
    {Status.OOM, Status.OVER_BUDGET, Status.LEAK, Status.REGRESSION, Status.FAILED}
)
_NOT_STORED = frozenset(
    {Status.OOM, Status.OVER_BUDGET, Status.LEAK, Status.FAILED, Status.UNGATED, Status.SKIPPED}
)
#: The values of the failing statuses, for readers of plain data (JSON, JUnit).
FAILING_STATUSES = frozenset(status.value for status in _FAILING)


def rank_of(value: str) -> int:
    """The rank of a status given as text; unknown text ranks after every status."""
    try:
        # By value: a report sorts every record by it, and Status(value) costs more.
        return _RANK_BY_VALUE[value]
    except (KeyError, TypeError):
        pass
    try:
        return Status(value).rank
    except ValueError:
        return len(_RANK)


def is_stored(value: str) -> bool:
    """Whether a test with the status ``value`` may be stored; unknown text may not."""
    try:
        return Status(value).stored
    except ValueError:
        return False
