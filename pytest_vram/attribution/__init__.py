"""Where the memory went: leak sites, the peak's breakdown by category and module, and
allocator snapshots in PyTorch's format, on every backend. See ``docs/attribution.md``.

On the default path only the peak's category totals are taken, for every test measured on the
sim or cpu backend (from the sim's storage tracker, or the cpu allocator counter's log). A leak
check records sites only during its confirmation steps, the modules are named under
``--vram-breakdown`` (and the categories on cuda for a baseline entry that stores them), and
snapshots are taken when ``--vram-snapshot-on-fail`` is given.
"""

from __future__ import annotations

from pytest_vram.attribution.breakdown import CATEGORIES, category_figures, describe_growth

__all__ = ["CATEGORIES", "category_figures", "describe_growth"]
