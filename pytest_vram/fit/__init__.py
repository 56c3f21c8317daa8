"""What fits: the largest size of a step for a GPU's memory (``vram.max_size``), and the
``pytest-vram fit`` command that asks it for each GPU size and layout of a model."""

from __future__ import annotations

from pytest_vram.fit.maxsize import MaxSizeResult, max_size
from pytest_vram.fit.search import largest

__all__ = ["MaxSizeResult", "largest", "max_size"]
