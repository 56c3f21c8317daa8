"""The terminal report's lines for multi-rank tests: each one's peak on each rank."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pytest_vram.report.text import size_text

__all__ = ["rank_lines"]


def rank_lines(tests: list[Mapping[str, Any]]) -> list[str]:
    """The per-rank lines of the terminal report: each multi-rank test's peak on each rank."""
    lines = []
    for test in tests:
        ranks = test.get("ranks")
        if not ranks:
            continue
        if not lines:
            lines.append("peak allocated per rank:")
        peaks = ", ".join(
            f"rank {entry['rank']} {size_text(entry['figures'].get('peak_allocated'))}"
            for entry in ranks
        )
        lines.append(
            f"  {test.get('nodeid')}: {peaks} (max {size_text(test.get('peak_allocated'))})"
        )
    return lines
