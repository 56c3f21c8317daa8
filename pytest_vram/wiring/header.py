"""The session header's line: which backend measures, and which baseline file it compares with."""

from __future__ import annotations

import pytest

from pytest_vram.backends import BackendUnavailable, resolve_name
from pytest_vram.baselines.store import BaselineStore, file_name_for
from pytest_vram.options import Settings
from pytest_vram.wiring.pool import BackendPool
from pytest_vram.wiring.runend import shown_path
from pytest_vram.wiring.selection import is_xdist_controller

__all__ = ["header_line"]


def header_line(
    config: pytest.Config, settings: Settings, store: BaselineStore, pool: BackendPool
) -> str:
    """``vram: backend cpu (--vram-backend=auto), device class 'cpu', baselines ...``; the
    backend is made here if no test has made it yet."""
    asked = settings.backend
    if is_xdist_controller(config):
        # The controller measures nothing: its workers make the backend.
        return f"vram: backend {resolve_name(asked)} (--vram-backend={asked}), in each worker"
    try:
        backend = pool.get(asked)
    except BackendUnavailable as exc:
        return f"vram: backend {asked}: not available here ({exc})"
    device = pool.device_classes[backend.name]
    path = settings.baseline_dir / file_name_for(device)
    stored = store.get(device)
    entries = len(stored.entries) if stored is not None else 0
    return (
        f"vram: backend {backend.name} (--vram-backend={asked}), device class {device!r}, "
        f"baselines {shown_path(path)} ({entries} {'entry' if entries == 1 else 'entries'})"
    )
