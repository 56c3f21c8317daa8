"""The ``pytest-vram`` command: each subcommand lives in the module that owns its logic."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


class CliError(Exception):
    """A problem with the command's input: printed as ``pytest-vram: error: ...``, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    from pytest_vram import estimate, junitfiles

    parser = argparse.ArgumentParser(
        prog="pytest-vram", description="GPU memory figures for PyTorch code."
    )
    subcommands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    estimate.add_cli_parser(subcommands)
    junitfiles.add_cli_parsers(subcommands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except CliError as exc:
        print(f"pytest-vram: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    # Under ``python -m`` this file is __main__, a second copy of the module: run the
    # package's own main so that subcommands raise the CliError it catches.
    from pytest_vram.cli import main as package_main

    sys.exit(package_main())
