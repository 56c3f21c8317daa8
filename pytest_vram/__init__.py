"""pytest-vram: GPU memory as a tested property of PyTorch code."""

from pytest_vram.errors import VramWarning
from pytest_vram.marks import (
    max_vram,
    requires_vram,
    vram_backend,
    vram_tolerance,
    vram_world_size,
)
from pytest_vram.version import __version__

__all__ = [
    "VramWarning",
    "__version__",
    "max_vram",
    "requires_vram",
    "vram_backend",
    "vram_tolerance",
    "vram_world_size",
]
