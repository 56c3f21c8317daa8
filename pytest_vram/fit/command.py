"""``pytest-vram fit``: for each GPU size, the largest micro-batch of each layout that fits."""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pytest_vram.errors import UsageError
from pytest_vram.fit.layouts import (
    FIT_DTYPES,
    FIT_RECOMPUTES,
    FIT_ZERO_STAGES,
    Layout,
    check_step,
    config_builder,
    load_builder,
)
from pytest_vram.fit.table import FitTable, Row, estimated_batch, row_from_dict
from pytest_vram.units import SizeError, parse_size
from pytest_vram.written import file_problem, reason_of

__all__ = ["DEFAULT_CAPACITIES", "add_cli_parser", "run_fit"]

#: The GPU classes of the table: 24 GB (L4, RTX 4090), 40 and 80 GB (A100), 48 GB (L40S,
#: A6000), 94 GB (H100 NVL), 141 GB (H200), 180 GB (B200).
DEFAULT_CAPACITIES = ("24GB", "40GB", "48GB", "80GB", "94GB", "141GB", "180GB")

_USAGE = """\
pytest-vram fit (--config CONFIG.json | --build MODULE:FUNCTION) [--capacity SIZE ...]
       [--dtype fp32|bf16|fp16 ...] [--recompute none|full ...] [--zero 0|2|3 ...]
       [--gpus N] [--tp N] [--seq S] [--max-batch B] [--json] [--html PATH]"""

_EPILOG = """\
Each combination of the listed --dtype, --recompute and --zero values is one layout; for each
GPU size and layout the table gives the largest micro-batch (sequences per GPU) whose training
step fits, found on the simulated device as rank 0 of --gpus ranks, and beside it the analytical
estimator's answer for the same inputs. The last column is the cheapest layout that fits one
sequence: no recompute before recompute, then the lowest ZeRO stage, then the larger batch.

--build MODULE:FUNCTION names a function that receives a layout (.dtype, .recompute, .zero,
.gpus, .tp, .seq, .compute_dtype) and returns step(batch), one training step; it runs on the
simulated CUDA device, inside a fake process group of --gpus ranks.
"""


def add_cli_parser(subcommands: Any) -> argparse.ArgumentParser:
    """Register ``pytest-vram fit`` on an argparse subparsers object."""
    parser = subcommands.add_parser(
        "fit",
        usage=_USAGE,
        help="the largest micro-batch of a model that fits each GPU size, on the simulated device",
        description=(
            "For each GPU size, the largest micro-batch whose training step fits, for each "
            "layout asked for, found by running the step on the simulated device."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", metavar="CONFIG.json", help="a Hugging Face config.json")
    source.add_argument("--build", metavar="MODULE:FUNCTION", help="a function building the step")
    add("--capacity", nargs="+", type=_size, metavar="SIZE", help="GPU sizes; default: "
        + ", ".join(DEFAULT_CAPACITIES))  # fmt: skip
    add("--dtype", nargs="+", choices=FIT_DTYPES, default=["bf16"], help="default: bf16")
    add("--recompute", nargs="+", choices=FIT_RECOMPUTES, default=["none"], help="default: none")
    add("--zero", nargs="+", type=int, choices=FIT_ZERO_STAGES, default=None,
        help="default: 3 with --gpus above 1, else 0")  # fmt: skip
    add("--gpus", type=_positive, default=1, metavar="N", help="data-parallel ranks; default: 1")
    add("--tp", type=_positive, default=1, metavar="N", help="tensor-parallel degree (--build)")
    add("--seq", type=_positive, default=2048, metavar="S", help="tokens a sequence; default: 2048")
    add("--max-batch", type=_positive, default=1024, metavar="B", help="default: 1024")
    add("--json", action="store_true", help="print one JSON object instead of a table")
    add("--html", type=Path, metavar="PATH", help="also write the table and its chart as HTML")
    parser.set_defaults(run=_run)
    return parser


def _size(text: str) -> str:
    try:
        parse_size(text)
    except SizeError as exc:
        raise UsageError(f"--capacity: {exc}") from None
    return text


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise UsageError(f"expected a positive whole number, got {text!r}")
    return value


def _run(args: argparse.Namespace) -> int:
    from pytest_vram.fit.render import write_html

    # Checked before the search, which can take minutes.
    problem = None if args.html is None else file_problem(args.html)
    if problem:
        raise UsageError(f"--html {args.html}: cannot write the page there: {problem}")
    capacities = list(args.capacity or DEFAULT_CAPACITIES)
    zeros = args.zero or [3 if args.gpus > 1 else 0]
    if args.gpus == 1 and any(zero for zero in zeros):
        raise UsageError("--zero 2 or 3 shards over --gpus: give --gpus 2 or more")
    layouts = [
        Layout(dtype, recompute, zero, args.gpus, args.tp, args.seq)
        for dtype, recompute, zero in itertools.product(args.dtype, args.recompute, zeros)
    ]
    progress = None if args.json else _progress
    # What the user's code prints (the builder, the step, the libraries they call) goes to
    # standard error: standard output holds the table or the JSON alone.
    with _output_to_stderr():
        if args.config:
            from pytest_vram.estimate import load_config

            config = load_config(args.config)
            builder = config_builder(config, args.config)
        else:
            config = None
            builder = load_builder(args.build)
        if len(layouts) > 1:
            # A process each: what one model's run leaves in torch's and transformers' caches
            # (known values, dispatch caches) must not change how the next one runs.
            table = _run_apart(args, layouts, capacities, progress)
        else:
            from pytest_vram.fit.search import NoAnswer

            try:
                table = run_fit(
                    builder, layouts, capacities, config, max_batch=args.max_batch, say=progress
                )
            except NoAnswer as exc:  # a step that leaks between attempts, say
                source = f"--config {args.config}" if args.config else f"--build {args.build}"
                raise UsageError(f"{source}: {exc}") from None
    if args.json:
        print(json.dumps(table.to_dict(), indent=2))
    else:
        print(table.format())
    if args.html:
        try:
            write_html(table, args.html)
        except OSError as exc:  # it turned unwritable while the search ran
            raise UsageError(
                f"--html {args.html}: cannot write the page: {reason_of(exc)}"
            ) from None
        if not args.json:
            print(f"HTML: {args.html}")
    return 0


@contextlib.contextmanager
def _output_to_stderr() -> Iterator[None]:
    """Send standard output to standard error, Python's and the file descriptor's (what a
    compiled extension or a child process writes)."""
    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no file descriptor 1: Python's stream alone
        saved = None
    else:
        os.dup2(2, 1)
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, 1)
            os.close(saved)


def _run_apart(
    args: argparse.Namespace, layouts: list[Layout], capacities: list[str], say: Any
) -> FitTable:
    rows = []
    source = ["--config", args.config] if args.config else ["--build", args.build]
    for layout in layouts:
        command = [
            sys.executable, "-m", "pytest_vram", "fit", *source, "--capacity", *capacities,
            "--dtype", layout.dtype, "--recompute", layout.recompute, "--zero", str(layout.zero),
            "--gpus", str(layout.gpus), "--tp", str(layout.tp), "--seq", str(layout.seq),
            "--max-batch", str(args.max_batch), "--json",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        last = _last_line(done.stderr)
        if done.returncode == 2 and last.startswith(_ERROR):
            raise UsageError(last.removeprefix(_ERROR))  # the same error for every layout
        if done.returncode != 0:
            raise UsageError(f"{layout.label}: the step failed: {last}")
        sys.stderr.write(done.stderr)  # what the user's code printed, and warnings
        (found,) = json.loads(done.stdout)["layouts"]
        rows.append(row_from_dict(layout, found))
        if say is not None:
            say(f"{layout.label}: {found['steps']} steps in {found['seconds']:.1f} s")
    return FitTable(capacities, [parse_size(c) for c in capacities], rows)


_ERROR = "pytest-vram: error: "


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else "no output"


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_fit(
    builder: Any,
    layouts: list[Layout],
    capacities: list[str],
    config: dict[str, Any] | None = None,
    *,
    max_batch: int = 1024,
    say: Any = None,
) -> FitTable:
    """Run each layout's step on a fresh simulated device and fill the table."""
    from pytest_vram.backends.sim.backend import SimBackend
    from pytest_vram.backends.sim.ranks import SimulatedRanks
    from pytest_vram.fit.sweep import sweep
    from pytest_vram.fit.trials import SimTrials

    limits = [parse_size(capacity) for capacity in capacities]
    rows = []
    # One simulated device for the run, as for a pytest session: each layout is one "test".
    backend = SimBackend()
    for layout in layouts:
        start = time.perf_counter()
        ranks = SimulatedRanks(layout.gpus, backend) if layout.gpus > 1 else None
        if ranks is not None:
            ranks.start()
        backend.begin_test()
        steps = 0

        def count(size: int, capacity: int, fits: bool) -> None:
            nonlocal steps
            steps += 1

        try:
            step = check_step(builder(layout), builder)
            fits = sweep(SimTrials(backend), step, limits, hi=max_batch, on_attempt=count)
            del step  # the layout's model goes before the next one is built
        finally:
            backend.end_test()
            if ranks is not None:
                ranks.stop()
        estimated = [
            estimated_batch(config, layout, limit, max_batch) if config else None
            for limit in limits
        ]
        seconds = time.perf_counter() - start
        rows.append(Row(layout, fits, estimated, steps, seconds))
        if say is not None:
            say(f"{layout.label}: {steps} steps in {seconds:.1f} s")
    return FitTable(capacities, limits, rows)
