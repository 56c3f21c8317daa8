"""``--vram-sim-cuda-available``: GPU guards evaluated at collection let tests through.

``@pytest.mark.skipif(not torch.cuda.is_available(), ...)``, a module's ``pytestmark`` and a
parametrization over the devices there are read when the test file is imported, before any
test runs and so before the simulated device answers ``torch.cuda.is_available()``. With the
option, and only where there is no real GPU, ``torch.cuda.is_available()`` answers True (and
``device_count()`` 1) while pytest collects; the tests it lets through run on the simulated
device, which answers the same while they run. Without it a skipped test stays skipped.
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["CollectionCuda"]


class CollectionCuda:
    """Answers the GPU guards of collection as the simulated device will."""

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Any:
        import torch

        cuda = torch.cuda
        if cuda.is_available():  # a real GPU: nothing to simulate
            return (yield)
        saved = cuda.is_available, cuda.device_count
        cuda.is_available, cuda.device_count = (lambda: True), (lambda: 1)
        try:
            return (yield)
        finally:
            cuda.is_available, cuda.device_count = saved
