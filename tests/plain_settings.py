"""Settings as the options give them by default, for tests of the pieces without pytest runs."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from pytest_vram.options import Settings
from pytest_vram.units import parse_tolerance

SETTINGS = Settings(
    report=True,
    backend="sim",
    cpu_counter="auto",
    sim_capacity=None,
    baseline_dir=Path("baselines"),
    tolerance=parse_tolerance("5%"),
    update_baselines=False,
    prune_baselines=False,
    strict=False,
    json_path=None,
    markdown_path=None,
    html_path=None,
    junit_properties=True,
    snapshot_dir=None,
)


def settings(**changes: Any) -> Settings:
    return dataclasses.replace(SETTINGS, **changes)
