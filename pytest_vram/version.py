"""The installed version of pytest-vram (pyproject.toml's ``version`` is the same)."""

__version__ = "0.1.0"
