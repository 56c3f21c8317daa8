"""The estimator's inputs: the accepted values, parameter counts and the checked options."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from decimal import Decimal, InvalidOperation
from typing import Any

MODES = ("inference", "train")
DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
OPTIMIZERS = ("adamw", "adam8bit", "sgd", "adafactor")
OFFLOADS = ("none", "optimizer", "all")
RECOMPUTES = ("none", "selective", "full")
ATTENTIONS = ("flash", "eager")
ZERO_STAGES = (0, 1, 2, 3)

DEFAULT_SEQ = 2048
#: Weight formats that only inference models: checkpoints store their linear weights quantised.
QUANTIZED = frozenset({"fp8", "int8", "int4"})

_COUNT_RE = re.compile(r"^(-?[0-9][0-9_,]*(?:\.[0-9]+)?(?:[eE][+]?[0-9]+)?)\s*([kKmMbBtT]?)$")
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
COUNT_FORMS = "a whole number such as 7000000000, 7e9, 7.5e9, 7B, 1.5B, 350M, 1.8T"


class EstimateError(ValueError):
    """Input the estimator cannot use: a bad option, a missing or malformed config."""


def parse_count(value: object, name: str = "params") -> int:
    """A parameter count: an int, an integral float (``7e9``) or a string (``"7B"``)."""
    if isinstance(value, bool):
        raise EstimateError(f"{name} must be {COUNT_FORMS}; got {value!r}")
    if isinstance(value, int):
        number = Decimal(value)
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise EstimateError(f"{name} must be {COUNT_FORMS}; got {value!r}")
        number = Decimal(repr(value))
    elif isinstance(value, str):
        match = _COUNT_RE.match(value.strip())
        if match is None:
            raise EstimateError(f"{name} must be {COUNT_FORMS}; got {value!r}")
        try:
            number = Decimal(match.group(1).replace("_", "").replace(",", ""))
        except InvalidOperation:
            raise EstimateError(f"{name} must be {COUNT_FORMS}; got {value!r}") from None
        number *= _COUNT_SUFFIX[match.group(2).lower()]
    else:
        raise EstimateError(f"{name} must be {COUNT_FORMS}; got {value!r}")
    if number <= 0:
        raise EstimateError(f"{name} must be positive; got {value!r}")
    if number != number.to_integral_value():
        raise EstimateError(f"{name} must be a whole number of parameters; got {value!r}")
    return int(number)


@dataclass(frozen=True)
class Options:
    """The checked options of one estimate; ``dp = gpus / (tp x pp)``."""

    mode: str
    dtype: str
    optimizer: str
    batch: int
    seq: int
    gpus: int
    dp: int
    zero: int
    offload: str
    tp: int
    pp: int
    recompute: str
    attention: str

    @property
    def train(self) -> bool:
        return self.mode == "train"


def check_options(
    *,
    mode: str,
    dtype: str,
    optimizer: str,
    batch: int,
    seq: int | None,
    gpus: int,
    zero: int,
    offload: str,
    tp: int,
    pp: int,
    recompute: str,
    attention: str,
) -> Options:
    """:class:`Options` from ``estimate``'s keyword arguments; :class:`EstimateError` for a
    value out of range. ``seq`` left as None becomes :data:`DEFAULT_SEQ`."""
    _choice("mode", mode, MODES)
    _choice("dtype", dtype, DTYPES)
    _choice("optimizer", optimizer, OPTIMIZERS)
    # True == 1, so a bool would pass the membership test below.
    if isinstance(zero, bool) or not isinstance(zero, int):
        raise EstimateError(f"zero must be one of 0, 1, 2, 3; got {zero!r}")
    _choice("zero", zero, ZERO_STAGES)
    _choice("offload", offload, OFFLOADS)
    _choice("recompute", recompute, RECOMPUTES)
    _choice("attention", attention, ATTENTIONS)
    batch = _positive("batch", batch)
    gpus = _positive("gpus", gpus)
    tp = _positive("tp", tp)
    pp = _positive("pp", pp)
    seq = DEFAULT_SEQ if seq is None else _positive("seq", seq)
    # dp is known once check_layout has seen that tp x pp divides gpus.
    return Options(
        mode, dtype, optimizer, batch, seq, gpus, 1, zero, offload, tp, pp, recompute, attention
    )


def check_layout(o: Options) -> Options:
    """The data-parallel degree, once the layout and the offload are known to fit together."""
    if o.gpus % (o.tp * o.pp):
        raise EstimateError(f"gpus ({o.gpus}) must be a multiple of tp x pp ({o.tp} x {o.pp})")
    if o.train and o.dtype in QUANTIZED:
        raise EstimateError(
            f"training with {o.dtype} weights is not modelled: fp16/bf16 (mixed precision) and "
            "fp32 are; quantised weights are for inference"
        )
    if o.offload == "optimizer" and not o.train:
        raise EstimateError("offload 'optimizer' applies to training (inference has no optimizer)")
    if o.offload == "optimizer" and o.zero == 0:
        raise EstimateError("offload 'optimizer' needs ZeRO stage 1, 2 or 3 (as DeepSpeed does)")
    if o.offload == "all" and o.zero != 3:
        raise EstimateError("offload 'all' moves the ZeRO-3 shards of weights: it needs zero 3")
    return replace(o, dp=o.gpus // (o.tp * o.pp))


def _choice(name: str, value: object, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        options = ", ".join(str(c) for c in choices)
        raise EstimateError(f"{name} must be one of {options}; got {value!r}")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimateError(f"{name} must be a positive integer; got {value!r}")
    return value
