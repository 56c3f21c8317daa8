"""The ``history`` subcommand of ``pytest-vram``: a branch's memory over its commits.

``pytest-vram history DIR --html PAGE`` writes the page; the Markdown table of the largest
steps goes to ``--markdown FILE`` or, without either option, to standard output. It exits 0
whatever the steps: the page reports the past, a pull request's comparison gates.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from pytest_vram.atomic import write_atomic
from pytest_vram.errors import UsageError
from pytest_vram.report.history import read_history, steps_markdown
from pytest_vram.units import SizeError, Tolerance, parse_tolerance

__all__ = ["add_cli_parser"]


def add_cli_parser(subcommands: Any) -> None:
    """Add ``history`` to the ``pytest-vram`` command."""
    parser = subcommands.add_parser(
        "history",
        help="chart each test's peak over the --vram-json documents of successive commits",
        description=(
            "Read the --vram-json documents in DIR (one or more per commit, each naming its "
            "commit and date), and write a self-contained HTML page with each test's peak "
            "over the commits, the steps up marked, and a Markdown table of the largest steps."
        ),
    )
    parser.add_argument("directory", metavar="DIR", help="a folder of --vram-json documents")
    parser.add_argument("--html", metavar="PAGE", help="write the HTML page here")
    parser.add_argument(
        "--markdown",
        metavar="FILE",
        help="write the table of the largest steps here ('-' for standard output, the default "
        "without --html)",
    )
    parser.add_argument(
        "--tolerance",
        default="5%",
        type=_tolerance,
        metavar="TOL",
        help="a step is a rise beyond this over the commit before: a percentage (5%%) or a "
        "size (64MiB); default 5%%",
    )
    parser.add_argument(
        "--max-charts",
        type=int,
        default=None,
        metavar="N",
        help="charts on the page: the tests that stepped up first, then the largest peaks "
        "(default 300)",
    )
    parser.set_defaults(run=_run_history)


def _tolerance(text: str) -> Tolerance:
    try:
        return parse_tolerance(text)
    except SizeError as exc:
        raise UsageError(f"--tolerance: {exc}") from None


def _run_history(args: argparse.Namespace) -> int:
    history = read_history(args.directory, args.tolerance)
    if args.html:
        from pytest_vram.report.historypage import MAX_CHARTS, render_history_html

        charts = MAX_CHARTS if args.max_charts is None else max(0, args.max_charts)
        _write(args.html, render_history_html(history, charts))
        print(f"pytest-vram: wrote {args.html}", file=sys.stderr)
    markdown = args.markdown or (None if args.html else "-")
    if markdown == "-":
        print(steps_markdown(history), end="")
    elif markdown:
        _write(markdown, steps_markdown(history))
    return 0


def _write(path: str, text: str) -> None:
    try:
        write_atomic(Path(path), text)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror or exc}") from None
