"""``--vram-sim-cuda-available``: GPU guards evaluated at collection let tests through.

``@pytest.mark.skipif(not torch.cuda.is_available(), ...)``, a module's ``pytestmark``, a
parametrization over the devices there are, and a root ``conftest.py`` that builds its device
list when imported are read before any test runs and so before the simulated device answers
``torch.cuda.is_available()``. With the option (or its ini setting), and only where there is no
real GPU, ``torch.cuda.is_available()`` answers True (and ``device_count()`` 1) while pytest
imports the initial conftest files and while it collects; the tests it lets through run on the
simulated device, which answers the same while they run. Without it a skipped test stays
skipped.
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["CollectionCuda", "wanted_early"]


def wanted_early(early_config: pytest.Config) -> bool:
    """Whether the run asks for the simulated device at collection, read before conftest files
    are imported (from the command line and the ini file, as ``Settings`` reads them later)."""
    args = early_config.known_args_namespace
    flag = getattr(args, "vram_sim_cuda_available", None)
    wanted = early_config.getini("vram_sim_cuda_available") if flag is None else flag
    backend = getattr(args, "vram_backend", None) or early_config.getini("vram_backend") or "auto"
    return bool(wanted) and backend in ("auto", "sim")


class CollectionCuda:
    """Answers the GPU guards of conftest imports and collection as the simulated device will."""

    def __init__(self) -> None:
        self._saved: Any = None

    def start(self) -> None:
        import torch

        cuda = torch.cuda
        if self._saved is not None or cuda.is_available():  # a real GPU: nothing to simulate
            return
        self._saved = cuda.is_available, cuda.device_count
        cuda.is_available, cuda.device_count = (lambda: True), (lambda: 1)

    def stop(self) -> None:
        saved, self._saved = self._saved, None
        if saved is not None:
            import torch

            torch.cuda.is_available, torch.cuda.device_count = saved

    @pytest.hookimpl(wrapper=True)
    def pytest_collection(self, session: pytest.Session) -> Any:
        self.start()
        try:
            return (yield)
        finally:
            self.stop()
