"""The backend one measured test runs on: named by its marker or the settings, the others
paused, told whether to compute, and checked against the test's ``requires_vram``."""

from __future__ import annotations

import pytest

from pytest_vram.backends import Backend, BackendUnavailable
from pytest_vram.backends.sim.runmodes import COMPUTING, COMPUTING_BECAUSE, ON_A_GUESS
from pytest_vram.marks import MarkerError, VramMarks
from pytest_vram.stash import MARKER_ERROR
from pytest_vram.units import describe_size, format_size
from pytest_vram.wiring.pool import BackendPool

__all__ = ["backend_for"]


def backend_for(
    item: pytest.Item, marks: VramMarks, pool: BackendPool, default: str, *, cuda_shown: bool
) -> Backend:
    """The backend ``item`` runs on, ready for it; fails the test with a usage error when its
    markers are malformed or the backend cannot run here, skips it when the device is smaller
    than its ``requires_vram``. ``cuda_shown``: whether its code sees the simulated device's
    CUDA (a test simulated only because every test is gated sees the machine's answers)."""
    try:
        if MARKER_ERROR in item.stash:
            raise item.stash[MARKER_ERROR]
        backend = pool.get(marks.backend or default)
    except (MarkerError, BackendUnavailable) as exc:
        problem = f"usage error in {item.nodeid}: {exc}"
    else:
        problem = None
    if problem is not None:
        pytest.fail(problem, pytrace=False)
    if len(pool.backends) > 1:  # the only one is this test's: nothing else to pause
        pool.pause_all(keep=backend)
    stash = item.stash  # values on demand's choice, for the simulated device
    backend.use_values(
        stash.get(COMPUTING, False),
        stash.get(COMPUTING_BECAUSE, None),
        guess=stash.get(ON_A_GUESS, False),
    )
    backend.show_cuda(cuda_shown)
    if marks.required is not None:
        total = backend.total_memory()
        if total is not None and total < marks.required:
            raise pytest.skip.Exception(
                f"requires_vram({describe_size(marks.required_as_written)}): the "
                f"{backend.name} device has {format_size(total)}",
                _use_item_location=True,  # reported at the test, as a marker's skip is
            )
    return backend
