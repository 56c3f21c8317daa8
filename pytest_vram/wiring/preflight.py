"""Before any test runs: can the outputs the options ask for be written?

The usual causes of a run that ends in an error (a directory that is a file, a place that
cannot be written) are found here, so that a long run does not end without its results.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pytest_vram.written import file_problem, probe_directory

if TYPE_CHECKING:
    from pytest_vram.options import Settings

__all__ = ["preflight", "preflight_problems"]


def preflight_problems(settings: Settings, environ: Mapping[str, str] | None = None) -> list[str]:
    """Why the outputs the options ask for could not be written, one line each; none when
    all can. Checked before the tests run, so that a long run does not end in an error."""
    environ = os.environ if environ is None else environ
    problems = []
    if settings.update_baselines or settings.prune_baselines:
        option = "--vram-update-baselines"
        if not settings.update_baselines:
            option = "--vram-prune-baselines"
        problem = _directory_problem(settings.baseline_dir)
        if problem:
            problems.append(
                f"{option}: cannot write baselines in {settings.baseline_dir}: {problem} "
                "(--vram-baseline-dir / vram_baseline_dir choose the directory)"
            )
    for option, path in (
        ("--vram-json", settings.json_path),
        ("--vram-markdown", settings.markdown_path),
        ("--vram-html", settings.html_path),
    ):
        problem = None if path is None else file_problem(path)
        if problem:
            problems.append(f"{option} {path}: cannot write the report there: {problem}")
    summary = environ.get("GITHUB_STEP_SUMMARY")
    if summary and (settings.report or settings.markdown_path is not None):
        problem = file_problem(Path(summary), append=True)
        if problem:
            problems.append(
                f"$GITHUB_STEP_SUMMARY {summary}: cannot append the memory table: {problem}"
            )
    return problems


def preflight(settings: Settings, environ: Mapping[str, str] | None = None) -> None:
    """Raise pytest.UsageError naming each output that could not be written."""
    problems = preflight_problems(settings, environ)
    if problems:
        raise pytest.UsageError("\n".join(problems))


def _directory_problem(directory: Path) -> str | None:
    """Why files could not be created in ``directory`` (made if missing), or None."""
    if directory.exists() and not directory.is_dir():
        return "it is a file, not a directory"
    return probe_directory(directory)
