"""Where the memory went: leak sites, the peak's breakdown by category and module, and
allocator snapshots in PyTorch's format, on every backend. See ``docs/attribution.md``.

Nothing here runs on the default path: a leak check records sites only during its
confirmation steps, the breakdown is taken when asked for (``--vram-breakdown``, or a baseline
entry that stores categories), and snapshots when ``--vram-snapshot-on-fail`` is given.
"""

from __future__ import annotations

from pytest_vram.attribution.breakdown import CATEGORIES, category_figures, describe_growth

__all__ = ["CATEGORIES", "category_figures", "describe_growth"]
