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

__all__ = ["clashes", "preflight", "preflight_problems"]


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


def clashes(settings: Settings, junit_path: str | None = None, *, xdist: bool = False) -> list[str]:
    """Why the options cannot work together, one line each: two outputs on one path (the
    last written would replace the other), an output on a baseline file or in the baseline
    directory (it would replace what was stored), or a prune that cannot see the tests."""
    problems = []
    outputs = [
        (option, path)
        for option, path in (
            ("--vram-json", settings.json_path),
            ("--vram-markdown", settings.markdown_path),
            ("--vram-html", settings.html_path),
            ("--junitxml", Path(junit_path) if junit_path else None),
            ("--vram-snapshot-on-fail", settings.snapshot_dir),
        )
        if path is not None
    ]
    seen: dict[Path, str] = {}
    baselines = _resolved(settings.baseline_dir)
    for option, path in outputs:
        where = _resolved(path)
        if where in seen:
            problems.append(
                f"{seen[where]} and {option} both name {path}: each output needs its own path"
            )
            continue
        seen[where] = option
        if where == baselines or baselines in where.parents:
            problems.append(
                f"{option} {path} is in the baseline directory {settings.baseline_dir}: it "
                "would overwrite or mix with the stored baselines; write it elsewhere"
            )
    if xdist and settings.prune_baselines:
        problems.append(
            "--vram-prune-baselines needs the whole collection, which the pytest-xdist "
            "controller does not see: run the prune without -n (-p no:xdist)"
        )
    return problems


def _resolved(path: Path) -> Path:
    """``path`` made absolute with its links followed, as far as it exists."""
    try:
        return path.expanduser().resolve()
    except (OSError, RuntimeError):
        return path.absolute()


def _directory_problem(directory: Path) -> str | None:
    """Why files could not be created in ``directory`` (made if missing), or None."""
    if directory.exists() and not directory.is_dir():
        return "it is a file, not a directory"
    return probe_directory(directory)
