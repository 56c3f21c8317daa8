"""What ``pytest-vram fit`` runs: a training step of the user's model in one layout.

A layout is a precision, a recompute policy, a ZeRO stage and a number of GPUs. The step is
built by the user's function (``--build MODULE:FUNCTION``) or, from a Hugging Face
config.json (``--config``), as transformers builds the model: on the meta device, then
``fully_shard`` (FSDP2) per decoder layer and for the root for ZeRO 2 and 3, then materialised
on the (simulated) device. One step is a forward on ``batch`` sequences with the labels, a
backward, a fresh AdamW's step and ``zero_grad``: the first step's peak, optimizer states
made while the gradients are alive.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import reprlib
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pytest_vram.errors import UsageError

__all__ = [
    "FIT_DTYPES",
    "FIT_RECOMPUTES",
    "FIT_ZERO_STAGES",
    "Layout",
    "check_step",
    "config_builder",
    "load_builder",
]

FIT_DTYPES = ("fp32", "bf16", "fp16")
FIT_RECOMPUTES = ("none", "full")
# ZeRO 1 shards only optimizer states, which FSDP2 has no mode for.
FIT_ZERO_STAGES = (0, 2, 3)

Step = Callable[[int], Any]


@dataclass(frozen=True)
class Layout:
    """One configuration of the table: what ``--build`` functions receive."""

    dtype: str
    recompute: str
    zero: int
    gpus: int
    tp: int
    seq: int

    @property
    def label(self) -> str:
        recompute = "" if self.recompute == "none" else f", recompute {self.recompute}"
        sharding = f"ZeRO {self.zero} over {self.gpus}" if self.gpus > 1 else "1 GPU"
        tp = f", tp {self.tp}" if self.tp > 1 else ""
        return f"{self.dtype}, {sharding}{tp}{recompute}"

    @property
    def compute_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    def to_dict(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "recompute": self.recompute,
            "zero": self.zero,
            "gpus": self.gpus,
            "tp": self.tp,
            "seq": self.seq,
        }


def load_builder(spec: str) -> Callable[[Layout], Step]:
    """The function ``MODULE:FUNCTION`` names; the current directory is importable, as under
    ``python -m``."""
    module_name, _, function = spec.partition(":")
    if not module_name or not function:
        raise UsageError(f"--build {spec!r}: expected MODULE:FUNCTION, such as mymodel:build")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--build {spec!r}: cannot import {module_name!r}: {exc}") from None
    except SyntaxError as exc:  # IndentationError too
        where = f"{exc.filename}, line {exc.lineno}" if exc.filename else "unknown place"
        raise UsageError(
            f"--build {spec!r}: cannot import {module_name!r}: {exc.msg} ({where})"
        ) from None
    except Exception as exc:  # the module's own code failed while it was imported
        raise UsageError(
            f"--build {spec!r}: importing {module_name!r} raised "
            f"{_one_line(exc)} ({_innermost(exc)})"
        ) from None
    builder = getattr(module, function, None)
    if not callable(builder):
        raise UsageError(f"--build {spec!r}: {module.__file__} has no function {function!r}")
    return builder


def check_step(step: object, builder: Callable[..., Any]) -> Step:
    """``step`` when a builder's answer is one: a function of the batch size."""
    if callable(step):
        return step
    name = f"{getattr(builder, '__module__', '?')}:{getattr(builder, '__qualname__', builder)}"
    raise UsageError(
        f"--build {name}: it returned {reprlib.repr(step)} ({type(step).__name__}), not a "
        "step: return step(batch), a function that runs one training step on batch sequences"
    )


def _one_line(exc: BaseException) -> str:
    message = " ".join(str(exc).split())
    return type(exc).__name__ + (f": {message}" if message else "")


def _innermost(exc: BaseException) -> str:
    """``file, line N`` of the innermost frame of ``exc``'s traceback."""
    tb = exc.__traceback__
    if tb is None:
        return "no traceback"
    while tb.tb_next is not None:
        tb = tb.tb_next
    return f"{tb.tb_frame.f_code.co_filename}, line {tb.tb_lineno}"


def config_builder(config: dict[str, Any], source: str) -> Callable[[Layout], Step]:
    """A builder of the step of the transformers model that ``config`` describes."""
    try:
        from transformers import AutoConfig, AutoModelForCausalLM
    except ImportError:
        raise UsageError(
            f"--config {source}: building the model from its config needs transformers "
            "(pip install transformers); or give --build MODULE:FUNCTION"
        ) from None
    values = dict(config)
    model_type = values.pop("model_type", None)
    try:
        hf_config = AutoConfig.for_model(model_type, **values)
    except (KeyError, ValueError) as exc:
        raise UsageError(
            f"--config {source}: transformers cannot build model_type {model_type!r}: {exc}"
        ) from None

    def build(layout: Layout) -> Step:
        return _hf_step(AutoModelForCausalLM, hf_config, layout)

    return build


def _hf_step(auto: Any, hf_config: Any, layout: Layout) -> Step:
    import torch

    if layout.tp > 1:
        raise UsageError("--tp with --config: build the tensor-parallel model with --build")
    with torch.device("meta"):
        # fp32 parameters, whatever the config's dtype: the master weights of mixed precision.
        model = auto.from_config(hf_config, attn_implementation="sdpa", **_fp32())
    if layout.recompute == "full":
        # transformers 5 renamed it and its argument; 4.x has only the old names.
        kwargs = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    mixed = layout.dtype != "fp32"
    if layout.zero >= 2 and layout.gpus > 1:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cuda", (layout.gpus,))
        policy = MixedPrecisionPolicy(param_dtype=layout.compute_dtype if mixed else None)
        reshard = layout.zero == 3
        for block in _decoder_layers(model):
            fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
        mixed = False  # FSDP2 computes in param_dtype itself
    model.to_empty(device="cuda")
    model.train()
    vocab = hf_config.vocab_size
    not_packed = _not_packed()

    def step(batch: int) -> None:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        tokens = torch.randint(0, vocab, (batch, layout.seq), device="cuda")
        autocast = (
            torch.autocast("cuda", dtype=layout.compute_dtype)
            if mixed
            else contextlib.nullcontext()
        )
        with autocast, not_packed:
            loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _fp32() -> dict[str, Any]:
    """transformers 5 names the argument ``dtype``; 4.x, ``torch_dtype``."""
    import torch
    import transformers

    major = int(transformers.__version__.split(".")[0])
    return {"dtype" if major >= 5 else "torch_dtype": torch.float32}


def _not_packed() -> contextlib.AbstractContextManager[Any]:
    """Every row of the batch is one sequence: transformers' check for packed sequences reads
    the position ids' values, which the shape-only device knows only for small batches."""
    try:
        from transformers import masking_utils
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        return contextlib.nullcontext()
    from unittest import mock

    return mock.patch.object(masking_utils, "find_packed_sequence_indices", lambda ids: None)


def _decoder_layers(model: Any) -> list[Any]:
    """The model's decoder layers: its longest ModuleList."""
    import torch

    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []
