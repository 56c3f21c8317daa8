"""One test's span on the simulated device, shape-only or computing, for tests that drive the
backend themselves rather than through the plugin."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pytest_vram.backends.sim.backend import SimBackend


@contextlib.contextmanager
def simulated(computing: bool = False, **options: Any) -> Iterator[SimBackend]:
    """A test on a new simulated device made with ``options`` (``SimBackend``'s), run
    shape-only or ``computing`` (on real CPU tensors)."""
    backend = SimBackend(**options)
    backend.use_values(computing)
    backend.begin_test()
    try:
        yield backend
    finally:
        backend.end_test()
