"""The report files a run writes: ``--vram-json``, ``--vram-markdown``, ``--vram-html`` and
the ``$GITHUB_STEP_SUMMARY`` table, all from one document.

Each is renamed over the old file once whole (:mod:`pytest_vram.atomic`). Nothing here raises:
a failure is an error line in :class:`pytest_vram.written.Written` and the other files are
still written. The Markdown and HTML renderers are imported only when asked for.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pytest_vram.atomic import write_atomic
from pytest_vram.report.commit import commit_fields
from pytest_vram.written import Written, reason_of

if TYPE_CHECKING:
    from pytest_vram.options import Settings

__all__ = ["write_outputs"]


def write_outputs(
    make_document: Callable[[], dict[str, Any]], settings: Settings, step_summary: str | None
) -> Written:
    """The JSON, Markdown and HTML files the options ask for; never raises.

    The document is built only when some output wants it. A failure to render or write one
    output is an error line and does not stop the others.
    """
    written = Written()
    wants_markdown = settings.markdown_path is not None or bool(settings.report and step_summary)
    if not (settings.json_path or wants_markdown or settings.html_path):
        return written
    built: list[dict[str, Any]] = []
    if not _attempt(
        written, "cannot build the memory report", lambda: built.append(make_document())
    ):
        return written
    document = built[0]
    # (what a failure says, the path to name when written, what writes it), in the order
    # the lines are printed.
    outputs: list[tuple[str, Path | None, Callable[[], None]]] = []
    if settings.json_path is not None:
        path = settings.json_path
        # The commit measured, for pytest-vram history; a document that names one keeps it.
        run = document.setdefault("run", {})
        if isinstance(run, dict) and "commit" not in run:
            _attempt(written, "cannot tell the commit", lambda: run.update(commit_fields()))
        outputs.append(
            (
                f"cannot write --vram-json {path}",
                path,
                lambda path=path: write_atomic(path, json.dumps(document, indent=2) + "\n"),
            )
        )
    if wants_markdown:
        from pytest_vram.report.markdown import append_step_summary, render_markdown

        rendered: list[str] = []
        if _attempt(
            written,
            "cannot render the Markdown report",
            lambda: rendered.append(render_markdown(document)),
        ):
            markdown = rendered[0]
            if settings.markdown_path is not None:
                path = settings.markdown_path
                outputs.append(
                    (
                        f"cannot write --vram-markdown {path}",
                        path,
                        lambda path=path: write_atomic(path, markdown),
                    )
                )
            if step_summary:
                outputs.append(
                    (
                        f"cannot append to $GITHUB_STEP_SUMMARY {step_summary}",
                        None,
                        lambda: append_step_summary(markdown, step_summary),
                    )
                )
    if settings.html_path is not None:
        from pytest_vram.report.html import render_html

        path = settings.html_path
        outputs.append(
            (
                f"cannot write --vram-html {path}",
                path,
                lambda path=path: write_atomic(path, render_html(document)),
            )
        )
    # Each is renamed over the old file: a full disk or a killed run leaves the last report whole.
    for failure, shown, write in outputs:
        if _attempt(written, failure, write) and shown is not None:
            written.lines.append(f"wrote {shown}")
    return written


def _attempt(written: Written, failure: str, action: Callable[[], object]) -> bool:
    """Run ``action``; on an error, add a line saying ``failure`` and why, and return False.
    An OSError is told in the operating system's words, anything else with its type."""
    try:
        action()
    except OSError as exc:
        written.errors.append(f"{failure}: {reason_of(exc)}")
    except Exception as exc:
        written.errors.append(f"{failure}: {type(exc).__name__}: {exc}")
    else:
        return True
    return False
