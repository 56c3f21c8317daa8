"""The plugin's own hooks, for conftest.py files and other plugins to implement."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from pytest_vram.backends import Backend


@pytest.hookspec(firstresult=True)
def pytest_vram_device_class(backend: Backend) -> str | None:
    """Name the device class of ``backend``: the key of its baseline file.

    The default is the GPU model on cuda (``NVIDIA H100 80GB HBM3``) and the backend's name on
    cpu and sim. Return another name to share baselines between models that measure alike, or
    to keep apart machines that do not; return None to keep the default.
    """


def pytest_vram_update_environment(environment: dict[str, Any], backend: Backend) -> None:
    """Add fields to (or change fields of) the environment recorded for ``backend``: it is
    stored in each baseline file and written to the JSON report and JUnit properties.

    ``environment`` holds at least ``backend``, ``device`` (the device class) and ``torch``.
    """
