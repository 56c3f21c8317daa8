"""The ``.gitignore`` of the baseline directory: a writer's lock and the temporary file a
killed writer can leave stay out of commits."""

from __future__ import annotations

from pathlib import Path

from pytest_vram.atomic import TEMPORARY_SUFFIX
from pytest_vram.baselines.locks import LOCK_SUFFIX

__all__ = ["GITIGNORE_PATTERNS", "ensure_gitignore"]

GITIGNORE_PATTERNS = (f".*{LOCK_SUFFIX}", f".*{TEMPORARY_SUFFIX}")


def ensure_gitignore(directory: Path) -> None:
    """A ``.gitignore`` in the baseline directory that keeps lock and temporary files out of
    commits; missing patterns are appended to one the user wrote."""
    path = directory / ".gitignore"
    try:
        existing = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        existing = None
    lines = [] if existing is None else existing.splitlines()
    missing = [pattern for pattern in GITIGNORE_PATTERNS if pattern not in lines]
    if not missing:
        return
    text = "".join(f"{pattern}\n" for pattern in missing)
    if existing is None:
        text = "# pytest-vram: the baseline writer's lock and temporary files\n" + text
    elif existing and not existing.endswith("\n"):
        text = "\n" + text
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)
