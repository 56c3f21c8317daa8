"""``pytest-vram estimate``: its arguments and its output."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from typing import Any, TypeVar

from pytest_vram.errors import UsageError
from pytest_vram.estimate.core import estimate
from pytest_vram.estimate.options import (
    ATTENTIONS,
    DTYPES,
    MODES,
    OFFLOADS,
    OPTIMIZERS,
    RECOMPUTES,
    ZERO_STAGES,
    EstimateError,
    parse_count,
)

_USAGE = """\
pytest-vram estimate (--config CONFIG.json | --params N) [--mode inference|train]
       [--dtype fp32|fp16|bf16|fp8|int8|int4] [--optimizer adamw|adam8bit|sgd|adafactor]
       [--batch B] [--seq S] [--gpus N] [--zero 0|1|2|3] [--offload none|optimizer|all]
       [--tp N] [--pp N] [--recompute none|selective|full] [--attention flash|eager] [--json]"""

_EPILOG = """\
defaults: --mode inference --dtype bf16 --optimizer adamw --batch 1 --seq 2048 (or the
config's max_position_embeddings when smaller) --gpus 1 --zero 0 --offload none --tp 1 --pp 1
--recompute none --attention flash.

N accepts 7000000000, 7e9, 7B, 1.5B, 350M. --gpus is the total: dp = gpus / (tp x pp), and
ZeRO shards across dp. --batch counts sequences per data-parallel rank (the micro-batch in
training); in inference the KV cache holds batch x seq tokens. With --params only, weights,
gradients and optimizer states are exact and activations, logits and KV cache are 0: they need
--config. per_gpu_bytes can be a budget: @max_vram(estimate(...).per_gpu_bytes).
"""

_Choice = TypeVar("_Choice", str, int)


def add_cli_parser(subcommands: Any) -> argparse.ArgumentParser:
    """Register ``pytest-vram estimate`` on an argparse subparsers object."""
    parser = subcommands.add_parser(
        "estimate",
        usage=_USAGE,
        help="estimate the GPU memory of a model from its config.json or parameter count",
        description=(
            "Estimate per-GPU memory (weights, gradients, optimizer states, activations, "
            "logits, KV cache) of a decoder LLM from a Hugging Face config.json or a "
            "parameter count."
        ),
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add = parser.add_argument
    add("--config", metavar="CONFIG.json", help="a Hugging Face config.json (or its directory)")
    add("--params", metavar="N", type=_count, help="a parameter count instead of a config: 7e9, 7B")
    _add_choice(parser, "--mode", MODES, "inference", "default: inference")
    _add_choice(parser, "--dtype", DTYPES, "bf16", "default: bf16")
    _add_choice(parser, "--optimizer", OPTIMIZERS, "adamw", "training only; default: adamw")
    _add_positive(parser, "--batch", "B", 1, "sequences per data-parallel rank; default: 1")
    _add_positive(
        parser,
        "--seq",
        "S",
        None,
        "tokens per sequence; default: 2048 (less if max_position_embeddings is)",
    )
    _add_positive(parser, "--gpus", "N", 1, "total GPUs; default: 1")
    _add_choice(parser, "--zero", ZERO_STAGES, 0, "ZeRO stage; default: 0")
    _add_choice(parser, "--offload", OFFLOADS, "none", "CPU offload of ZeRO shards; default: none")
    _add_positive(parser, "--tp", "N", 1, "tensor-parallel degree; default: 1")
    _add_positive(parser, "--pp", "N", 1, "pipeline-parallel degree; default: 1")
    _add_choice(
        parser,
        "--recompute",
        RECOMPUTES,
        "none",
        "activation recomputation (training); default: none",
    )
    _add_choice(
        parser,
        "--attention",
        ATTENTIONS,
        "flash",
        "flash never materialises the s x s scores; default: flash",
    )
    add("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=_run)
    return parser


def _add_choice(
    parser: argparse.ArgumentParser,
    option: str,
    choices: Sequence[_Choice],
    default: _Choice,
    help: str,
) -> None:
    # choices= documents the values in --help; the type= check runs first and words the error.
    def one_of(text: str) -> _Choice:
        for choice in choices:
            # Numbers may come padded (" 3"), as int() accepts them; names must match exactly.
            if text == str(choice) or (isinstance(choice, int) and text.strip() == str(choice)):
                return choice
        raise UsageError(
            f"{option} must be one of {', '.join(str(c) for c in choices)}; got {text!r}"
        )

    parser.add_argument(option, choices=choices, type=one_of, default=default, help=help)


def _add_positive(
    parser: argparse.ArgumentParser, option: str, metavar: str, default: int | None, help: str
) -> None:
    def positive(text: str) -> int:
        stripped = text.strip()
        if not stripped.isdigit() or int(stripped) < 1:
            raise UsageError(f"{option} must be a positive integer; got {text!r}")
        return int(stripped)

    parser.add_argument(option, metavar=metavar, type=positive, default=default, help=help)


def _count(text: str) -> int:
    try:
        return parse_count(text, "--params")
    except EstimateError as exc:
        raise UsageError(str(exc)) from None


def _run(args: argparse.Namespace) -> int:
    # One rule, one message: an argparse mutually exclusive group would word the missing and
    # the doubled case differently, and exit through argparse rather than the command.
    if (args.config is None) == (args.params is None):
        raise UsageError("give exactly one of --config CONFIG.json or --params N")
    result = estimate(
        params=args.params,
        config=args.config,
        mode=args.mode,
        dtype=args.dtype,
        optimizer=args.optimizer,
        batch=args.batch,
        seq=args.seq,
        gpus=args.gpus,
        zero=args.zero,
        offload=args.offload,
        tp=args.tp,
        pp=args.pp,
        recompute=args.recompute,
        attention=args.attention,
    )
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.format())
    return 0
