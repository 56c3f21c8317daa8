"""A test's span on the simulated device as rank 0 of simulated ranks, for tests that drive the
backend themselves rather than through the plugin."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from pytest_vram.backends.sim.backend import SimBackend
from pytest_vram.backends.sim.ranks import SimulatedRanks


@contextlib.contextmanager
def ranks(world_size: int, monkeypatch: pytest.MonkeyPatch | None = None) -> Iterator[SimBackend]:
    """One test on the simulated device as rank 0 of ``world_size``, as the plugin runs it:
    the group first, then the fake mode; the fake mode ends first, then the group. What
    ``monkeypatch`` put over the ranks' own patches goes before the group stops, so that
    stopping it leaves torch's."""
    backend = SimBackend()
    group = SimulatedRanks(world_size, backend)
    group.start()
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.end_test()
        if monkeypatch is not None:
            monkeypatch.undo()
        group.stop()
