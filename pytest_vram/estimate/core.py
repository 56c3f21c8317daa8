"""``estimate()``: check the options, read the model, add up what each GPU holds."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from pytest_vram.estimate.config import MAX_SIZE
from pytest_vram.estimate.layout import count_footprint, model_footprint
from pytest_vram.estimate.model import Model, resolve_model
from pytest_vram.estimate.options import (
    EstimateError,
    Options,
    check_layout,
    check_options,
    parse_count,
)
from pytest_vram.estimate.result import Estimate


def estimate(
    params: int | float | str | None = None,
    config: str | os.PathLike[str] | Mapping[str, Any] | None = None,
    *,
    mode: str = "inference",
    dtype: str = "bf16",
    optimizer: str = "adamw",
    batch: int = 1,
    seq: int | None = None,
    gpus: int = 1,
    zero: int = 0,
    offload: str = "none",
    tp: int = 1,
    pp: int = 1,
    recompute: str = "none",
    attention: str = "flash",
) -> Estimate:
    """Estimate the memory per GPU of a model given by ``config`` or ``params``.

    ``config`` is a path to a config.json (or a model directory holding one) or the parsed
    dict; ``params`` a count such as ``7_000_000_000``, ``7e9`` or ``"7B"``. With ``params``
    only, weights, gradients and optimizer states are exact, while activations, logits and
    KV cache need the model's shape and are reported as 0 (a note says so).

    ``batch`` is the number of sequences per data-parallel rank (the micro-batch in
    training); ``seq`` defaults to 2048, or the config's ``max_position_embeddings`` when
    that is smaller. ``gpus`` is the total, split into ``tp x pp x dp``; ZeRO shards across
    ``dp``. Raises :class:`EstimateError` for input it cannot use.
    """
    o = check_options(
        mode=mode,
        dtype=dtype,
        optimizer=optimizer,
        batch=batch,
        seq=seq,
        gpus=gpus,
        zero=zero,
        offload=offload,
        tp=tp,
        pp=pp,
        recompute=recompute,
        attention=attention,
    )
    if (params is None) == (config is None):
        raise EstimateError("give exactly one of config (a config.json) or params (a count)")
    o = check_layout(o)

    notes: list[str] = []
    model: Model | None = None
    source: str | None = None
    if config is not None:
        model, source = resolve_model(config)
        notes += model.notes
    count = parse_count(params) if params is not None else None

    positions = model.max_positions if model is not None else None
    if isinstance(positions, int):
        if seq is None and 0 < positions < o.seq:
            o = replace(o, seq=positions)
        elif seq is not None and seq > positions:
            notes.append(
                f"seq {seq} is longer than the model's max_position_embeddings ({positions})"
            )

    inputs = _inputs(
        source if isinstance(config, (str, os.PathLike)) else None,
        count,
        model.model_type if model else None,
        o,
    )
    if model is None:
        assert count is not None
        gpu, host = count_footprint(count, o, notes)
        stage, parameters, active = 0, count, count
    else:
        stage, (gpu, host) = model_footprint(model, o, notes)
        parameters, active = model.parameters, model.active_parameters
    _check_real(max(sum(gpu.values()), sum(host.values())), source or f"params {count:,}")
    return Estimate(
        parameters=parameters,
        per_gpu_bytes=sum(gpu.values()),
        breakdown=gpu,
        host_bytes=sum(host.values()),
        host_breakdown=host,
        active_parameters=active,
        pipeline_stage=stage,
        inputs=inputs,
        notes=tuple(notes),
    )


def _check_real(nbytes: int, what: str) -> None:
    """Refuse a model that no machine could hold: its figures would be no budget at all."""
    if nbytes > MAX_SIZE:
        raise EstimateError(
            f"{what}: {nbytes:,} bytes per GPU is beyond any real model (a byte count holds at "
            f"most {MAX_SIZE:,}, 8 EiB); check the model's sizes"
        )


def _inputs(
    config: str | None, params: int | None, model_type: str | None, o: Options
) -> dict[str, Any]:
    """What the estimate was computed for, as ``--json`` prints it under ``inputs``."""
    return {
        "config": config,
        "params": params,
        "model_type": model_type,
        "mode": o.mode,
        "dtype": o.dtype,
        "optimizer": o.optimizer,
        "batch": o.batch,
        "seq": o.seq,
        "gpus": o.gpus,
        "dp": o.dp,
        "zero": o.zero,
        "offload": o.offload,
        "tp": o.tp,
        "pp": o.pp,
        "recompute": o.recompute,
        "attention": o.attention,
    }
