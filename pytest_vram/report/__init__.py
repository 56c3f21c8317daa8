"""The reports of a run, all rendered from one document.

- :mod:`.document`: the document (what ``--vram-json`` writes) built from the records;
- :mod:`.terminal`: the ``--vram-report`` summary;
- :mod:`.junit`: the ``vram_*`` JUnit XML properties;
- :mod:`.markdown`: the job-summary table (``--vram-markdown``, ``$GITHUB_STEP_SUMMARY``);
- :mod:`.html`: the self-contained page (``--vram-html``);
- :mod:`.text`: sizes, changes, plurals, aligned tables and environments as text.
"""

from pytest_vram.report.document import build_document, status_counts, totals
from pytest_vram.report.html import render_html
from pytest_vram.report.junit import junit_properties, suite_properties
from pytest_vram.report.markdown import append_step_summary, render_markdown
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
