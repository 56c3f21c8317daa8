"""The reports of a run, all rendered from one document (see :mod:`.document`)."""

from pytest_vram.report.document import build_document, junit_properties, terminal_lines, totals
from pytest_vram.report.html import render_html
from pytest_vram.report.markdown import append_step_summary, render_markdown, status_counts

__all__ = [
    "append_step_summary",
    "build_document",
    "junit_properties",
    "render_html",
    "render_markdown",
    "status_counts",
    "terminal_lines",
    "totals",
]
