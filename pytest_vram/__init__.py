"""pytest-vram: GPU memory as a tested property of PyTorch code."""

from pytest_vram.errors import VramWarning
from pytest_vram.wiring.marks import (
    max_vram,
    requires_vram,
    vram_backend,
    vram_tolerance,
    vram_world_size,
)

__version__ = "0.1.0"

__all__ = [
    "VramWarning",
    "__version__",
    "max_vram",
    "requires_vram",
    "vram_backend",
    "vram_tolerance",
    "vram_world_size",
]
