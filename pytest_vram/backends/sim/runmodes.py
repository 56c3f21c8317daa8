"""One run of a test on the simulated device: the mode values on demand chose for it, kept on
the test's item for the session to read, and how a run's reports say it ended."""

from __future__ import annotations

import pytest

from pytest_vram.errors import LeakError
from pytest_vram.raised import is_out_of_memory

__all__ = [
    "COMPUTING",
    "COMPUTING_BECAUSE",
    "MAY_RUN_AGAIN",
    "ON_A_GUESS",
    "RunAgain",
    "failed_or_xfailed",
    "first_failure_line",
    "run_again",
]

# What values on demand keeps on a test item (``item.stash``), set before a test on the
# simulated device runs; the session reads them.

#: Whether the test computes its values on the CPU (else it runs shape-only).
COMPUTING: pytest.StashKey[bool] = pytest.StashKey()
#: Whether it computes on a guess, within a host-memory budget.
ON_A_GUESS: pytest.StashKey[bool] = pytest.StashKey()
#: Why it computes, where its shape-only run failed: the first line of that failure.
COMPUTING_BECAUSE: pytest.StashKey[str] = pytest.StashKey()
#: While the test runs in a mode that is run again if it fails: "shape-only" (for want of
#: values) or "guess" (computing on a guess).
MAY_RUN_AGAIN: pytest.StashKey[str] = pytest.StashKey()


class RunAgain(BaseException):
    """Ends a run that will be run again, at its first failing subtest: what the subtests after
    it would report is the next run's. A BaseException, so that the test's ``except
    Exception`` does not stop it."""


def run_again(item: pytest.Item, exc: BaseException) -> bool:
    """Whether the run of ``item`` whose subtest failed with ``exc`` ends there, to be run
    again: shape-only for want of values (a memory verdict, a leak, the device's
    out-of-memory are the same computing); computing on a guess, past the guess's budget. A
    guess's run that fails otherwise goes on to its end: it may stand (see
    :meth:`~pytest_vram.backends.sim.ondemand.ValuesOnDemand.runtestprotocol`)."""
    tried = item.stash.get(MAY_RUN_AGAIN, None)
    if tried is None:
        return False
    if tried == "guess":
        return is_out_of_memory(exc)
    return not (isinstance(exc, LeakError) or is_out_of_memory(exc))


def failed_or_xfailed(reports: list[pytest.TestReport]) -> bool:
    # An xfailed test failed too: computing, it may pass (and xpass).
    return any(r.failed or (r.skipped and hasattr(r, "wasxfail")) for r in reports)


def first_failure_line(reports: list[pytest.TestReport]) -> str | None:
    for report in reports:
        if report.failed or hasattr(report, "wasxfail"):
            text = str(report.longrepr or "").strip()
            message = getattr(getattr(report.longrepr, "reprcrash", None), "message", None)
            line = (message or text).strip().splitlines()
            return line[0][:300] if line else None
    return None
