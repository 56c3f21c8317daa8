"""The reports of a run, all rendered from one document.

- :mod:`.document`: the document (what ``--vram-json`` writes) built from the records;
- :mod:`.terminal`: the ``--vram-report`` summary;
- :mod:`.junit`: the ``vram_*`` JUnit XML properties;
- :mod:`.markdown`: the job-summary table (``--vram-markdown``, ``$GITHUB_STEP_SUMMARY``);
- :mod:`.html`: the self-contained page (``--vram-html``), drawn with :mod:`.svg`;
- :mod:`.text`: sizes, changes, plurals, aligned tables and environments as text;
- :mod:`.outputs`: the report files a run writes, each whole or not at all.

Read back by ``pytest-vram summary`` and ``compare`` (:mod:`.commands`): :mod:`.junitfile` and
:mod:`.jsonfile` read a run's memory table, :mod:`.runcomparison` compares two, and
:mod:`.comparison` renders the pull-request comment.
"""

from __future__ import annotations

import importlib
from typing import Any

from pytest_vram.report.document import build_document, status_counts, totals
from pytest_vram.report.junit import junit_properties, suite_properties
from pytest_vram.report.terminal import terminal_lines

__all__ = [
    "append_step_summary",
    "build_document",
    "junit_properties",
    "render_html",
    "render_markdown",
    "status_counts",
    "suite_properties",
    "terminal_lines",
    "totals",
]

# Loaded on first use: most runs write no Markdown or HTML, and the plugin loads this package.
_LAZY = {
    "append_step_summary": "markdown",
    "render_markdown": "markdown",
    "render_html": "html",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
