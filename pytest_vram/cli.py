"""The ``pytest-vram`` command: each subcommand lives in the module that owns its logic.

Exit statuses: 0 success; 1 from ``compare`` when a test grew beyond the tolerance; 2 for
input a subcommand cannot use (argparse's own usage errors exit 2 as well).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pytest_vram import estimate
from pytest_vram.baselines import shards
from pytest_vram.errors import UsageError
from pytest_vram.fit import command as fit_command
from pytest_vram.report import commands as report_commands
from pytest_vram.report import historycommand
from pytest_vram.report.history import HistoryError
from pytest_vram.report.junitfile import JUnitFileError
from pytest_vram.version import __version__

#: Each subcommand's error for input it cannot use; all of them exit 2.
INPUT_ERRORS: tuple[type[Exception], ...] = (
    UsageError,
    estimate.EstimateError,
    JUnitFileError,
    shards.ShardError,
    HistoryError,
)


def build_parser() -> argparse.ArgumentParser:
    """The command's parser, with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="pytest-vram", description="GPU memory figures for PyTorch code."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    estimate.add_cli_parser(subcommands)
    fit_command.add_cli_parser(subcommands)
    report_commands.add_cli_parsers(subcommands)
    historycommand.add_cli_parser(subcommands)
    shards.add_cli_parser(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns its exit status."""
    parser = build_parser()
    try:
        # type= callables raise UsageError while parsing, so parsing is inside the try.
        args = parser.parse_args(argv)
        return int(args.run(args) or 0)
    except INPUT_ERRORS as exc:
        print(f"pytest-vram: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
