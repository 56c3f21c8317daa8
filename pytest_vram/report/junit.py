"""JUnit XML properties: ``vram_*`` on each measured test, ``vram_env_*`` on the suite.

Sizes are integer bytes, so ``pytest-vram summary`` and ``compare`` (and any CI tool) read
them back exactly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vram.record.record import TestRecord
from pytest_vram.report.document import baseline_peak, record_row, snapshot_of

__all__ = [
    "SUITE_ENVIRONMENT_KEYS",
    "junit_properties",
    "peak_line_text",
    "row_properties",
    "suite_properties",
]

#: The environment facts a suite carries as ``vram_env_<key>`` properties, in order.
SUITE_ENVIRONMENT_KEYS = (
    "backend",
    "device",
    "cpu_counter",
    "torch",
    "cuda",
    "hip",
    "driver",
    "total_memory",
)


def junit_properties(record: TestRecord) -> list[tuple[str, object]]:
    """The ``vram_*`` properties of one test: sizes as integer bytes."""
    return row_properties(record_row(record))


def row_properties(test: Mapping[str, Any]) -> list[tuple[str, object]]:
    """The ``vram_*`` properties of one row of the document."""
    props: list[tuple[str, object]] = [
        ("vram_backend", test["backend"]),
        ("vram_device", test["device"]),
        ("vram_peak_allocated", test["peak_allocated"]),
    ]
    baseline = baseline_peak(test)
    if baseline is not None:
        props.append(("vram_baseline", baseline))
    props += [
        ("vram_status", test["status"]),
        ("vram_start_allocated", test["start_allocated"]),
        ("vram_peak_increment", test["peak_increment"]),
        ("vram_leftover", test["leftover"]),
    ]
    # Figures a backend cannot measure are left out rather than written as empty values.
    for key in ("peak_reserved", "peak_device"):
        if test.get(key) is not None:
            props.append((f"vram_{key}", test[key]))
    leak = (test.get("scenarios") or {}).get("leak_check")
    if leak:
        props.append(("vram_leak_growth", leak["growth"]))
    # Under torchrun: each rank's figures, the figures above being their maximum.
    for entry in test.get("ranks") or ():
        for key in ("peak_allocated", "peak_reserved", "peak_device"):
            if key in entry["figures"]:
                props.append((f"vram_{key}_rank{entry['rank']}", entry["figures"][key]))
        props.append((f"vram_status_rank{entry['rank']}", entry["status"]))
    snapshot = snapshot_of(test)
    if snapshot is not None:
        props.append(("vram_snapshot", snapshot))
    # The lines alive at the peak of a test that failed: "BYTES CATEGORY FILE:LINE TEXT".
    for index, line in enumerate(test.get("peak_lines") or (), 1):
        props.append((f"vram_peak_line_{index}", peak_line_text(line)))
    return props


def peak_line_text(line: Mapping[str, Any]) -> str:
    """One peak line as a JUnit property value: ``1610612736 activations model.py:54 attn =
    q @ k.transpose(-2, -1)``; :func:`pytest_vram.report.peakchange.read_peak_line` reads it."""
    text = " ".join(str(line.get("text") or "").split())
    return f"{line['bytes']} {line['category']} {line['file']}:{line['line']} {text}".rstrip()


def suite_properties(environments: Mapping[str, Mapping[str, Any]]) -> list[tuple[str, str]]:
    """The ``vram_env_*`` properties of a run's environments, keyed by backend.

    One environment is spelt ``vram_env_device``; several ``vram_env_<backend>_device``.
    """
    props = []
    for name, environment in sorted(environments.items()):
        prefix = "vram_env" if len(environments) == 1 else f"vram_env_{name}"
        for key in SUITE_ENVIRONMENT_KEYS:
            if environment.get(key) is not None:
                props.append((f"{prefix}_{key}", str(environment[key])))
    return props
