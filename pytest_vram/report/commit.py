"""The commit a run measured, for the ``run`` section of its ``--vram-json`` document.

``pytest-vram history`` orders the documents of successive commits by it. The commit is
``$GITHUB_SHA`` where a workflow sets it, else the work tree's ``HEAD``; its date is the
commit's own (``git log``), so a document written later for an older commit still sorts by
when the code changed. Outside a git repository, or without git, the run has neither.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping

__all__ = ["commit_fields"]

# git answers in milliseconds; a hung credential prompt or network file system must not
# hold the end of a test run.
_TIMEOUT = 5.0


def commit_fields(
    cwd: str | os.PathLike[str] | None = None, environ: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``{"commit": sha, "commit_date": ISO 8601}``, as much of it as is known."""
    environ = os.environ if environ is None else environ
    wanted = (environ.get("GITHUB_SHA") or "").strip() or "HEAD"
    fields: dict[str, str] = {}
    if wanted != "HEAD":
        fields["commit"] = wanted
    try:
        done = subprocess.run(
            ["git", "log", "-1", "--format=%H%n%cI", wanted, "--"],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT,
            check=False,
            # Never ask for anything: a run in CI has no one to answer.
            env={**os.environ, "GIT_TERMINAL_PROMPT": "0"},
        )
    except (OSError, subprocess.SubprocessError):
        return fields
    lines = done.stdout.split()
    if done.returncode == 0 and len(lines) == 2:
        fields["commit"], fields["commit_date"] = lines
    return fields
