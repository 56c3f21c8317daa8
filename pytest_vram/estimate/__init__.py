"""Analytical GPU memory estimates for decoder language models.

``estimate(...)`` (and ``pytest-vram estimate``) computes, per GPU, the bytes of weights,
gradients, optimizer states, activations, logits and KV cache of a model described by a
Hugging Face ``config.json`` or by a bare parameter count, for a precision, an optimizer, a
ZeRO stage and a tensor/pipeline/data-parallel layout. The result's ``per_gpu_bytes`` can be
used directly as a ``max_vram`` budget.

Sources the arithmetic follows:

- model states: Rajbhandari et al., "ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models" (2020), section 3.1 and figure 1 (mixed-precision Adam is 16 bytes/param);
- activations: Korthikanti et al., "Reducing Activation Recomputation in Large Transformer
  Models" (2022), sections 4.1-4.3, generalised term by term to GQA, gated MLPs, MoE and MLA;
- KV cache: 2 x layers x KV heads x head_dim x tokens x bytes; MLA keeps its compressed latent.

docs/estimator.md spells out every term.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from pathlib import Path
from typing import Any

from pytest_vram.errors import UsageError
from pytest_vram.units import format_size

__all__ = [
    "ATTENTIONS",
    "DTYPES",
    "MODES",
    "OFFLOADS",
    "OPTIMIZERS",
    "RECOMPUTES",
    "SUPPORTED_MODEL_TYPES",
    "Estimate",
    "EstimateError",
    "Layer",
    "Model",
    "Tensor",
    "add_cli_parser",
    "count_parameters",
    "estimate",
    "format_si",
    "inference_layer_activations",
    "load_config",
    "model_from_config",
    "parse_count",
    "train_layer_activations",
]

MODES = ("inference", "train")
DTYPES = ("fp32", "fp16", "bf16", "fp8", "int8", "int4")
OPTIMIZERS = ("adamw", "adam8bit", "sgd", "adafactor")
OFFLOADS = ("none", "optimizer", "all")
RECOMPUTES = ("none", "selective", "full")
ATTENTIONS = ("flash", "eager")
ZERO_STAGES = (0, 1, 2, 3)

DEFAULT_SEQ = 2048
BREAKDOWN_KEYS = (
    "weights",
    "gradients",
    "optimizer",
    "activations",
    "logits",
    "kv_cache",
    "zero3_gathered",
)
HOST_KEYS = ("weights", "gradients", "optimizer")

# int4 checkpoints (GPTQ, AWQ) store, per group of 128 input weights, one fp16 scale and one
# 4-bit zero point: 2.5 bytes on top of the 64 bytes of packed weights.
INT4_GROUP_SIZE = 128
# bitsandbytes 8-bit optimizers: block-wise quantised states with one fp32 absmax per block
# of 256 values; tensors under 4096 elements keep 32-bit states.
ADAM8BIT_BLOCK = 256
ADAM8BIT_MIN_SIZE = 4096

_QUANTIZED = frozenset({"fp8", "int8", "int4"})
_COUNT_RE = re.compile(r"^(-?[0-9][0-9_,]*(?:\.[0-9]+)?(?:[eE][+]?[0-9]+)?)\s*([kKmMbBtT]?)$")
_COUNT_SUFFIX = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}
COUNT_FORMS = "a whole number such as 7000000000, 7e9, 7.5e9, 7B, 1.5B, 350M, 1.8T"


class EstimateError(ValueError):
    """Input the estimator cannot use: a bad option, a missing or malformed config."""


def _cdiv(a: int | Fraction, b: int = 1) -> int:
    """Ceiling division that stays exact for ints and fractions."""
    return math.ceil(Fraction(a) / b)


# --------------------------------------------------------------------------------------------
# Model structure


@dataclass(frozen=True)
class Tensor:
    """One weight (or ``copies`` identical weights, such as the experts of a layer).

    ``split`` is the dimension tensor parallelism cuts (Megatron: column-parallel layers cut
    the output rows, dim 0; row-parallel layers the input columns, dim 1), in units of
    ``unit`` (a head's width for attention projections, so KV heads are replicated rather
    than cut when there are fewer of them than ranks). ``quantized`` marks the linear weights
    that fp8/int8/int4 checkpoints store quantised; embeddings, norms and routers stay 16-bit.
    """

    name: str
    shape: tuple[int, ...]
    split: int | None = None
    unit: int = 1
    quantized: bool = False
    copies: int = 1

    @property
    def numel(self) -> int:
        return math.prod(self.shape) * self.copies

    def local_shape(self, tp: int) -> tuple[int, ...]:
        if self.split is None or tp == 1:
            return self.shape
        shape = list(self.shape)
        shape[self.split] = _cdiv(shape[self.split] // self.unit, tp) * self.unit
        return tuple(shape)

    def local_numel(self, tp: int) -> int:
        return math.prod(self.local_shape(tp)) * self.copies


@dataclass(frozen=True)
class Layer:
    """One decoder layer: its weights and the widths the activation and KV terms need.

    ``ffn`` is the dense MLP width, or in an MoE layer the total width of its shared experts
    (0 when it has none). ``kv_lora_rank > 0`` marks multi-head latent attention (MLA), whose
    cache holds the compressed latent and the decoupled RoPE key instead of per-head K and V.
    """

    tensors: tuple[Tensor, ...]
    heads: int
    kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    ffn: int
    experts: int = 0
    expert_ffn: int = 0
    top_k: int = 0
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    rope_head_dim: int = 0
    window: int | None = None
    gated: bool = True
    attention_dropout: bool = False
    hidden_dropout: bool = False

    @property
    def parameters(self) -> int:
        return sum(t.numel for t in self.tensors)

    @property
    def inactive_parameters(self) -> int:
        """Routed-expert weights a token does not use (all but ``top_k`` of the experts)."""
        if not self.experts:
            return 0
        per_expert = sum(t.numel // t.copies for t in self.tensors if t.copies == self.experts)
        return (self.experts - self.top_k) * per_expert


@dataclass(frozen=True)
class Model:
    """A decoder language model's weights and shapes, read from a config.json."""

    model_type: str
    hidden: int
    vocab: int
    tied: bool
    layers: tuple[Layer, ...]
    embedding: Tensor
    final_norm: Tensor
    lm_head: Tensor | None
    max_positions: int | None = None
    notes: tuple[str, ...] = ()

    @property
    def parameters(self) -> int:
        head = self.lm_head.numel if self.lm_head is not None else 0
        return (
            self.embedding.numel
            + self.final_norm.numel
            + head
            + sum(layer.parameters for layer in self.layers)
        )

    @property
    def active_parameters(self) -> int:
        """Parameters one token runs through (MoE: shared experts plus ``top_k`` routed)."""
        return self.parameters - sum(layer.inactive_parameters for layer in self.layers)


# --------------------------------------------------------------------------------------------
# Reading config.json

SUPPORTED_MODEL_TYPES = (
    "deepseek_v2",
    "deepseek_v3",
    "llama",
    "mistral",
    "mixtral",
    "qwen2",
    "qwen3",
)
_DENSE_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_hidden_layers",
    "vocab_size",
)
_MIXTRAL_KEYS = (*_DENSE_KEYS, "num_local_experts", "num_experts_per_tok")
_DEEPSEEK_KEYS = (
    *_DENSE_KEYS,
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "moe_intermediate_size",
    "n_routed_experts",
    "num_experts_per_tok",
)


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a config.json (or the config.json inside a model directory) as a dict."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise EstimateError(f"config file {str(p)!r} not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise EstimateError(f"cannot read config file {str(p)!r}: {exc}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise EstimateError(
            f"config file {str(p)!r} is not valid JSON: {exc.msg} at line {exc.lineno}, "
            f"column {exc.colno}"
        ) from None
    if not isinstance(data, dict):
        raise EstimateError(
            f"config file {str(p)!r} must hold a JSON object, not {type(data).__name__}"
        )
    return data


def _missing(cfg: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    return [k for k in keys if cfg.get(k) is None]


def _pos_int(cfg: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int:
    value = cfg.get(key)
    if value is None:
        if default is None:  # pragma: no cover - callers check required keys first
            raise EstimateError(f"{source}: key {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EstimateError(f"{source}: key {key!r} must be a positive integer, got {value!r}")
    return value


def _opt_int(cfg: Mapping[str, Any], key: str, source: str) -> int:
    """An integer key that may be absent, null or 0 (for example ``q_lora_rank``)."""
    value = cfg.get(key)
    if value is None or value == 0:
        return 0
    return _pos_int(cfg, key, source)


def model_from_config(cfg: Mapping[str, Any], source: str = "config") -> Model:
    """Build a :class:`Model` from a Hugging Face config dict; :class:`EstimateError` if the
    architecture is unknown or the config lacks keys its parameter count needs."""
    model_type = cfg.get("model_type")
    if model_type is None:
        missing = ", ".join(["model_type", *_missing(cfg, _DENSE_KEYS)])
        raise EstimateError(f"{source}: missing keys: {missing}")
    if model_type not in SUPPORTED_MODEL_TYPES:
        missing = _missing(cfg, _DENSE_KEYS)
        lacks = (
            f"; it also lacks keys a llama-style decoder has: {', '.join(missing)}"
            if missing
            else ""
        )
        raise EstimateError(
            f"{source}: unknown model_type {model_type!r} (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}){lacks}. Other architectures are not "
            "guessed: pass --params N for weights, gradients and optimizer states only"
        )
    required = {
        "mixtral": _MIXTRAL_KEYS,
        "deepseek_v2": _DEEPSEEK_KEYS,
        "deepseek_v3": _DEEPSEEK_KEYS,
    }.get(model_type, _DENSE_KEYS)
    missing = _missing(cfg, required)
    if missing:
        raise EstimateError(
            f"{source}: model_type {model_type!r} needs keys this config lacks: "
            f"{', '.join(missing)}"
        )
    if model_type.startswith("deepseek"):
        return _deepseek(cfg, source)
    return _llama_like(cfg, source)


def _windows(cfg: Mapping[str, Any], n_layers: int, source: str) -> list[int | None]:
    """Per layer, the sliding window its attention (and so its KV cache) is limited to."""
    model_type = cfg["model_type"]
    window = cfg.get("sliding_window")
    if window is not None:
        window = _pos_int(cfg, "sliding_window", source)
    layer_types = cfg.get("layer_types")
    if isinstance(layer_types, list) and len(layer_types) == n_layers:
        return [window if kind == "sliding_attention" else None for kind in layer_types]
    if window is None or model_type == "llama":
        return [None] * n_layers
    if model_type in ("qwen2", "qwen3"):
        # Qwen applies its window only with use_sliding_window, from max_window_layers on.
        if not cfg.get("use_sliding_window"):
            return [None] * n_layers
        first = cfg.get("max_window_layers") or 0
        return [window if i >= first else None for i in range(n_layers)]
    return [window] * n_layers  # mistral, mixtral: every layer


def _norm(name: str, width: int) -> Tensor:
    return Tensor(name, (width,))


def _mlp(prefix: str, hidden: int, ffn: int, copies: int = 1, bias: bool = False) -> list[Tensor]:
    tensors = [
        Tensor(f"{prefix}.gate_proj", (ffn, hidden), 0, 1, True, copies),
        Tensor(f"{prefix}.up_proj", (ffn, hidden), 0, 1, True, copies),
        Tensor(f"{prefix}.down_proj", (hidden, ffn), 1, 1, True, copies),
    ]
    if bias:
        tensors += [
            Tensor(f"{prefix}.gate_proj.bias", (ffn,), 0, 1, False, copies),
            Tensor(f"{prefix}.up_proj.bias", (ffn,), 0, 1, False, copies),
            Tensor(f"{prefix}.down_proj.bias", (hidden,), None, 1, False, copies),
        ]
    return tensors


def _embeddings(hidden: int, vocab: int, tied: bool) -> tuple[Tensor, Tensor, Tensor | None]:
    # Megatron splits both the input embedding and the output layer over the vocabulary.
    embedding = Tensor("embed_tokens", (vocab, hidden), 0)
    lm_head = None if tied else Tensor("lm_head", (vocab, hidden), 0)
    return embedding, _norm("norm", hidden), lm_head


def _decoder(
    cfg: Mapping[str, Any],
    model_type: str,
    hidden: int,
    vocab: int,
    tied: bool,
    layers: tuple[Layer, ...],
    notes: tuple[str, ...],
) -> Model:
    """A decoder with the embeddings, final norm and output layer every family shares."""
    embedding, final_norm, lm_head = _embeddings(hidden, vocab, tied)
    return Model(
        model_type,
        hidden,
        vocab,
        tied,
        layers,
        embedding,
        final_norm,
        lm_head,
        cfg.get("max_position_embeddings"),
        notes,
    )


def _llama_like(cfg: Mapping[str, Any], source: str) -> Model:
    model_type = cfg["model_type"]
    hidden = _pos_int(cfg, "hidden_size", source)
    n_layers = _pos_int(cfg, "num_hidden_layers", source)
    heads = _pos_int(cfg, "num_attention_heads", source)
    kv_heads = _pos_int(cfg, "num_key_value_heads", source, heads)
    head_dim = _pos_int(cfg, "head_dim", source, hidden // heads)
    ffn = _pos_int(cfg, "intermediate_size", source)
    vocab = _pos_int(cfg, "vocab_size", source)
    tied = bool(cfg.get("tie_word_embeddings", False))

    # Qwen2 always has q/k/v biases; llama and qwen3 follow attention_bias (o_proj included).
    qkv_bias = model_type == "qwen2" or bool(cfg.get("attention_bias"))
    o_bias = model_type in ("llama", "qwen3") and bool(cfg.get("attention_bias"))
    q_w, kv_w = heads * head_dim, kv_heads * head_dim
    attn = [
        Tensor("self_attn.q_proj", (q_w, hidden), 0, head_dim, True),
        Tensor("self_attn.k_proj", (kv_w, hidden), 0, head_dim, True),
        Tensor("self_attn.v_proj", (kv_w, hidden), 0, head_dim, True),
        Tensor("self_attn.o_proj", (hidden, q_w), 1, head_dim, True),
    ]
    if qkv_bias:
        attn += [
            Tensor("self_attn.q_proj.bias", (q_w,), 0, head_dim),
            Tensor("self_attn.k_proj.bias", (kv_w,), 0, head_dim),
            Tensor("self_attn.v_proj.bias", (kv_w,), 0, head_dim),
        ]
    if o_bias:
        attn.append(Tensor("self_attn.o_proj.bias", (hidden,)))
    if model_type == "qwen3":
        attn += [_norm("self_attn.q_norm", head_dim), _norm("self_attn.k_norm", head_dim)]
    norms = [_norm("input_layernorm", hidden), _norm("post_attention_layernorm", hidden)]

    if model_type == "mixtral":
        experts = _pos_int(cfg, "num_local_experts", source)
        top_k = _pos_int(cfg, "num_experts_per_tok", source)
        mlp = [
            Tensor("block_sparse_moe.gate", (experts, hidden)),
            *_mlp("block_sparse_moe.experts", hidden, ffn, experts),
        ]
        moe = {"ffn": 0, "experts": experts, "expert_ffn": ffn, "top_k": top_k}
    else:
        mlp = _mlp("mlp", hidden, ffn, bias=model_type == "llama" and bool(cfg.get("mlp_bias")))
        moe = {"ffn": ffn}

    tensors = tuple(attn + mlp + norms)
    attention_dropout = bool(cfg.get("attention_dropout") or 0)
    layers = tuple(
        Layer(
            tensors,
            heads,
            kv_heads,
            head_dim,
            head_dim,
            window=window,
            attention_dropout=attention_dropout,
            **moe,
        )
        for window in _windows(cfg, n_layers, source)
    )
    return _decoder(cfg, model_type, hidden, vocab, tied, layers, _quantization_note(cfg))


def _deepseek(cfg: Mapping[str, Any], source: str) -> Model:
    model_type = cfg["model_type"]
    hidden = _pos_int(cfg, "hidden_size", source)
    n_layers = _pos_int(cfg, "num_hidden_layers", source)
    heads = _pos_int(cfg, "num_attention_heads", source)
    ffn = _pos_int(cfg, "intermediate_size", source)
    vocab = _pos_int(cfg, "vocab_size", source)
    tied = bool(cfg.get("tie_word_embeddings", False))
    q_lora = _opt_int(cfg, "q_lora_rank", source)
    kv_lora = _pos_int(cfg, "kv_lora_rank", source)
    nope = _pos_int(cfg, "qk_nope_head_dim", source)
    rope = _pos_int(cfg, "qk_rope_head_dim", source)
    v_dim = _pos_int(cfg, "v_head_dim", source)
    moe_ffn = _pos_int(cfg, "moe_intermediate_size", source)
    n_routed = _pos_int(cfg, "n_routed_experts", source)
    n_shared = _opt_int(cfg, "n_shared_experts", source)
    top_k = _pos_int(cfg, "num_experts_per_tok", source)
    first_dense = _opt_int(cfg, "first_k_dense_replace", source)
    moe_freq = _pos_int(cfg, "moe_layer_freq", source, 1)
    bias = bool(cfg.get("attention_bias"))
    qk_dim = nope + rope

    # MLA: the down-projections are small and replicated across TP ranks (Megatron's
    # "duplicated" linears); the up-projections are cut by heads.
    attn: list[Tensor] = []
    if q_lora:
        attn += [
            Tensor("self_attn.q_a_proj", (q_lora, hidden), None, 1, True),
            _norm("self_attn.q_a_layernorm", q_lora),
            Tensor("self_attn.q_b_proj", (heads * qk_dim, q_lora), 0, qk_dim, True),
        ]
        if bias:
            attn.append(Tensor("self_attn.q_a_proj.bias", (q_lora,)))
    else:
        attn.append(Tensor("self_attn.q_proj", (heads * qk_dim, hidden), 0, qk_dim, True))
    attn += [
        Tensor("self_attn.kv_a_proj_with_mqa", (kv_lora + rope, hidden), None, 1, True),
        _norm("self_attn.kv_a_layernorm", kv_lora),
        Tensor("self_attn.kv_b_proj", (heads * (nope + v_dim), kv_lora), 0, nope + v_dim, True),
        Tensor("self_attn.o_proj", (hidden, heads * v_dim), 1, v_dim, True),
    ]
    if bias:
        attn += [
            Tensor("self_attn.kv_a_proj_with_mqa.bias", (kv_lora + rope,)),
            Tensor("self_attn.o_proj.bias", (hidden,)),
        ]
    norms = [_norm("input_layernorm", hidden), _norm("post_attention_layernorm", hidden)]
    mla = {
        "heads": heads,
        "kv_heads": heads,  # K and V are expanded per head for the attention itself
        "qk_head_dim": qk_dim,
        "v_head_dim": v_dim,
        "q_lora_rank": q_lora,
        "kv_lora_rank": kv_lora,
        "rope_head_dim": rope,
        "attention_dropout": bool(cfg.get("attention_dropout") or 0),
    }

    router = [Tensor("mlp.gate.weight", (n_routed, hidden))]
    if cfg.get("topk_method") == "noaux_tc":
        router.append(Tensor("mlp.gate.e_score_correction_bias", (n_routed,)))
    moe_mlp = [*router, *_mlp("mlp.experts", hidden, moe_ffn, n_routed)]
    if n_shared:
        moe_mlp += _mlp("mlp.shared_experts", hidden, moe_ffn * n_shared)
    dense_layer = Layer(tuple(attn + _mlp("mlp", hidden, ffn) + norms), ffn=ffn, **mla)
    moe_layer = Layer(
        tuple(attn + moe_mlp + norms),
        ffn=moe_ffn * n_shared,
        experts=n_routed,
        expert_ffn=moe_ffn,
        top_k=top_k,
        **mla,
    )
    layers = tuple(
        moe_layer if i >= first_dense and i % moe_freq == 0 else dense_layer
        for i in range(n_layers)
    )
    notes = list(_quantization_note(cfg))
    mtp = cfg.get("num_nextn_predict_layers") or 0
    if mtp:
        notes.append(
            f"the multi-token-prediction module (num_nextn_predict_layers={mtp}) is not "
            "counted: it is an extra training/speculative-decoding head that Transformers "
            "does not load"
        )
    return _decoder(cfg, model_type, hidden, vocab, tied, layers, tuple(notes))


def _quantization_note(cfg: Mapping[str, Any]) -> tuple[str, ...]:
    quant = cfg.get("quantization_config")
    if isinstance(quant, Mapping) and quant.get("quant_method"):
        return (
            f"the config declares {quant['quant_method']} quantization; --dtype decides the "
            "weight format estimated here",
        )
    return ()


def count_parameters(config: str | os.PathLike[str] | Mapping[str, Any]) -> int:
    """The parameter count of the model a config.json (path or dict) describes."""
    return _resolve_model(config)[0].parameters


def _resolve_model(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[Model, str]:
    if isinstance(config, Mapping):
        return model_from_config(config, "config"), "config"
    if isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        return model_from_config(load_config(source), source), source
    raise EstimateError(f"config must be a path or a dict, got {type(config).__name__}")


# --------------------------------------------------------------------------------------------
# Bytes per term


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


def _int4_bytes(numel: int, in_features: int | None = None) -> int:
    if in_features:
        groups = numel // in_features * _cdiv(in_features, INT4_GROUP_SIZE)
    else:
        groups = _cdiv(numel, INT4_GROUP_SIZE)
    return _cdiv(numel, 2) + 2 * groups + _cdiv(groups, 2)


def _dtype_bytes(numel: int, dtype: str, in_features: int | None = None) -> int:
    if dtype == "fp32":
        return 4 * numel
    if dtype in ("fp16", "bf16"):
        return 2 * numel
    if dtype in ("fp8", "int8"):
        return numel  # per-tensor or per-channel scales: well under 0.1%, not counted
    return _int4_bytes(numel, in_features)


def _weight_bytes(tensors: Iterable[Tensor], tp: int, dtype: str) -> int:
    total = 0
    for t in tensors:
        shape = t.local_shape(tp)
        numel = math.prod(shape) * t.copies
        if dtype in _QUANTIZED and not t.quantized:
            total += 2 * numel  # embeddings, norms, biases, routers stay in bf16
        else:
            in_features = shape[-1] if len(shape) == 2 else None
            total += _dtype_bytes(numel, dtype, in_features)
    return total


def _adam8bit_state(numel: int) -> int:
    if numel < ADAM8BIT_MIN_SIZE:
        return 8 * numel
    return 2 * numel + 2 * 4 * _cdiv(numel, ADAM8BIT_BLOCK)


def _optimizer_state(shape: tuple[int, ...], copies: int, optimizer: str) -> int:
    """Bytes of the optimizer's own state (no master weights) for ``copies`` tensors."""
    numel = math.prod(shape)
    if optimizer == "adamw":
        per = 8 * numel  # fp32 m and v
    elif optimizer == "adam8bit":
        per = _adam8bit_state(numel)
    elif optimizer == "sgd":
        per = 4 * numel  # fp32 momentum buffer
    elif len(shape) >= 2:
        # Adafactor (beta1=None): fp32 row and column statistics of the second moment.
        per = 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1])
    else:
        per = 4 * numel
    return per * copies


def _train_bytes_per_param(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


# --------------------------------------------------------------------------------------------
# Activations


def _act_bytes(dtype: str) -> int:
    # fp32 runs in fp32; every other format computes (and caches K/V) in 16-bit.
    return 4 if dtype == "fp32" else 2


def train_layer_activations(
    layer: Layer, hidden: int, batch: int, seq: int, e: int, tp: int, attention: str
) -> tuple[int, int]:
    """Bytes one layer keeps for its backward pass, as ``(linear, quadratic)`` in ``seq``.

    Korthikanti et al. (2022) section 4.1 count, term by term, with tensor parallelism ``tp``
    and sequence parallelism (every term divided by ``tp``). For a GPT layer (MHA, 4h GeLU
    MLP, dropout, eager attention) the sum is ``sbh(34 + 5as/h)`` bytes at ``e = 2``.
    """
    tok = batch * seq
    a = Fraction(layer.heads, tp)
    g = _cdiv(layer.kv_heads, tp)  # KV heads are replicated when there are fewer than ranks
    h = Fraction(hidden, tp)
    dq, dv = layer.qk_head_dim, layer.v_head_dim

    lin = Fraction(0)
    lin += 2 * e * tok * h  # inputs of the two norms
    lin += e * tok * h  # input of the QKV (or MLA down-) projections
    if layer.kv_lora_rank:
        lin += 2 * e * tok * Fraction(layer.kv_lora_rank, tp)  # latent norm and up-proj inputs
        lin += 2 * e * tok * Fraction(layer.q_lora_rank, tp)
    lin += e * tok * (a * dq + g * dq)  # Q and K, kept for QK^T
    lin += e * tok * g * dv  # V, kept for the product with the probabilities
    lin += e * tok * a * dv  # input of the output projection
    quad = Fraction(0)
    if attention == "eager":
        quad += e * batch * a * seq * seq  # softmax output
        if layer.attention_dropout:
            quad += batch * a * seq * seq + e * batch * a * seq * seq  # mask and its output
    else:
        lin += 4 * batch * a * seq  # flash keeps only the fp32 log-sum-exp per row
    if layer.hidden_dropout:
        lin += 2 * tok * h  # dropout masks after attention and after the MLP

    lin += e * tok * h  # input of the MLP (or router and experts)
    per_ffn = 4 if layer.gated else 2  # gated: gate, act(gate), up, product; else in and out
    lin += per_ffn * e * tok * Fraction(layer.ffn, tp)
    if layer.experts:
        k = layer.top_k
        lin += 8 * tok * Fraction(layer.experts, tp)  # fp32 router logits and scores
        lin += 2 * e * tok * k * h  # tokens dispatched to experts and their outputs
        lin += per_ffn * e * tok * k * Fraction(layer.expert_ffn, tp)
    return _cdiv(lin), _cdiv(quad)


def inference_layer_activations(
    layer: Layer, hidden: int, batch: int, seq: int, e: int, tp: int, attention: str
) -> int:
    """Peak working set of one layer's forward pass: nothing is kept for a backward pass.

    The residual stream and the normalised input, plus the larger of the attention block
    (Q, K, V, their rotary copies, the attention output; eager adds scores and
    probabilities) and the MLP block (act(gate), up, product; MoE: dispatched tokens too).
    """
    tok = batch * seq
    a = Fraction(layer.heads, tp)
    g = _cdiv(layer.kv_heads, tp)  # KV heads are replicated when there are fewer than ranks
    dq, dv = layer.qk_head_dim, layer.v_head_dim
    base = 2 * e * tok * hidden
    attn = e * tok * (2 * a * dq + 2 * g * dq + g * dv + a * dv)
    attn += e * tok * (layer.q_lora_rank + layer.kv_lora_rank + layer.rope_head_dim)
    if attention == "eager":
        attn += 2 * e * batch * a * seq * seq
    per_ffn = 3 if layer.gated else 2
    mlp = per_ffn * e * tok * Fraction(layer.ffn, tp)
    if layer.experts:
        k = layer.top_k
        mlp += 8 * tok * layer.experts
        mlp += e * tok * k * (2 * hidden + per_ffn * Fraction(layer.expert_ffn, tp))
    return _cdiv(base + max(attn, mlp))


def _kv_cache_bytes(layer: Layer, batch: int, seq: int, e: int, tp: int) -> int:
    tokens = min(seq, layer.window) if layer.window else seq
    if layer.kv_lora_rank:
        # MLA caches the compressed latent and the shared RoPE key, replicated on TP ranks.
        width = layer.kv_lora_rank + layer.rope_head_dim
    else:
        width = _cdiv(layer.kv_heads, tp) * (layer.qk_head_dim + layer.v_head_dim)
    return width * tokens * batch * e


# --------------------------------------------------------------------------------------------
# The estimate


@dataclass(frozen=True)
class Estimate:
    """Memory per GPU, in bytes. ``per_gpu_bytes`` is the sum of ``breakdown``.

    ``host_bytes`` is what CPU offload moves to host memory, per GPU (``host_breakdown`` by
    term). With pipeline parallelism, figures are those of ``pipeline_stage``, the stage with
    the largest footprint.
    """

    parameters: int
    per_gpu_bytes: int
    breakdown: dict[str, int]
    host_bytes: int = 0
    host_breakdown: dict[str, int] = field(default_factory=dict)
    active_parameters: int = 0
    pipeline_stage: int = 0
    inputs: dict[str, Any] = field(default_factory=dict)
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        """The JSON object ``pytest-vram estimate --json`` prints."""
        gpus = int(self.inputs.get("gpus", 1))
        return {
            "parameters": self.parameters,
            "active_parameters": self.active_parameters,
            "per_gpu_bytes": self.per_gpu_bytes,
            "breakdown": dict(self.breakdown),
            "host_bytes": self.host_bytes,
            "host_bytes_total": self.host_bytes * gpus,
            "host_breakdown": dict(self.host_breakdown),
            "pipeline_stage": self.pipeline_stage,
            "inputs": dict(self.inputs),
            "notes": list(self.notes),
        }

    def format(self) -> str:
        """A readable breakdown: IEC units, the SI value and the exact bytes."""
        i = self.inputs
        source = f"from {i['config']}" if i.get("config") else "from a parameter count"
        model = f"{i['model_type']}, " if i.get("model_type") else ""
        params = f"{self.parameters:,} parameters ({_short_count(self.parameters)})"
        if self.active_parameters and self.active_parameters != self.parameters:
            params += f", {self.active_parameters:,} active per token"
        if i["mode"] == "train":
            precision = "mixed precision" if i["dtype"] in ("fp16", "bf16") else "full precision"
            what = f"train, {i['dtype']} {precision}, {i['optimizer']}, recompute {i['recompute']}"
        else:
            what = f"inference, {i['dtype']} weights"
        layout = (
            f"{i['gpus']} GPU{'s' if i['gpus'] != 1 else ''} = dp {i['dp']} x tp {i['tp']} "
            f"x pp {i['pp']}, ZeRO-{i['zero']}, offload {i['offload']}"
        )
        lines = [
            f"pytest-vram estimate: {model}{params}, {source}",
            f"  {what}; batch {i['batch']} x seq {i['seq']}, {i['attention']} attention",
            f"  {layout}",
            "",
            _row(f"per GPU{_stage(self.pipeline_stage, i['pp'])}", "IEC", "SI", "bytes"),
        ]
        for key in BREAKDOWN_KEYS:
            value = self.breakdown[key]
            lines.append(_row(f"  {key}", format_size(value), format_si(value), f"{value:,}"))
        total = self.per_gpu_bytes
        lines.append(_row("  total", format_size(total), format_si(total), f"{total:,}"))
        if self.host_bytes:
            lines += ["", _row("host memory per GPU (offload)", "", "", "")]
            for key in HOST_KEYS:
                value = self.host_breakdown.get(key, 0)
                if value:
                    lines.append(
                        _row(f"  {key}", format_size(value), format_si(value), f"{value:,}")
                    )
            host = self.host_bytes
            lines.append(_row("  total", format_size(host), format_si(host), f"{host:,}"))
        if self.notes:
            lines += ["", "notes:"]
            lines += [f"  - {note}" for note in self.notes]
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.format()


def _stage(stage: int, pp: int) -> str:
    return f" (pipeline stage {stage} of {pp})" if pp > 1 else ""


def _row(label: str, iec: str, si: str, exact: str) -> str:
    return f"{label:<34}{iec:>12}{si:>12}{exact:>22}".rstrip()


def _short_count(n: int) -> str:
    for suffix, factor in (("T", 10**12), ("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= factor:
            return f"{n / factor:.2f}{suffix}"
    return str(n)


def format_si(nbytes: int) -> str:
    """``65.53 GB`` style (powers of 1000); below 1 kB as ``512 B``."""
    for unit, factor in (("TB", 10**12), ("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= factor:
            return f"{nbytes / factor:.2f} {unit}"
    return f"{nbytes} B"


def _choice(name: str, value: object, choices: tuple[Any, ...]) -> None:
    if value not in choices:
        options = ", ".join(str(c) for c in choices)
        raise EstimateError(f"{name} must be one of {options}; got {value!r}")


def _positive(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise EstimateError(f"{name} must be a positive integer; got {value!r}")
    return value


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
    _choice("mode", mode, MODES)
    _choice("dtype", dtype, DTYPES)
    _choice("optimizer", optimizer, OPTIMIZERS)
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
    if seq is not None:
        seq = _positive("seq", seq)
    if (params is None) == (config is None):
        raise EstimateError("give exactly one of config (a config.json) or params (a count)")
    if gpus % (tp * pp):
        raise EstimateError(f"gpus ({gpus}) must be a multiple of tp x pp ({tp} x {pp})")
    dp = gpus // (tp * pp)
    if mode == "train" and dtype in _QUANTIZED:
        raise EstimateError(
            f"training with {dtype} weights is not modelled: fp16/bf16 (mixed precision) and "
            "fp32 are; quantised weights are for inference"
        )
    if offload == "optimizer" and mode != "train":
        raise EstimateError("offload 'optimizer' applies to training (inference has no optimizer)")
    if offload == "optimizer" and zero == 0:
        raise EstimateError("offload 'optimizer' needs ZeRO stage 1, 2 or 3 (as DeepSpeed does)")
    if offload == "all" and zero != 3:
        raise EstimateError("offload 'all' moves the ZeRO-3 shards of weights: it needs zero 3")

    notes: list[str] = []
    model: Model | None = None
    source: str | None = None
    if config is not None:
        model, source = _resolve_model(config)
        notes += model.notes
    count = parse_count(params) if params is not None else None

    if seq is None:
        seq = DEFAULT_SEQ
        if model is not None and isinstance(model.max_positions, int) and model.max_positions > 0:
            seq = min(seq, model.max_positions)
    elif model is not None and isinstance(model.max_positions, int) and seq > model.max_positions:
        notes.append(
            f"seq {seq} is longer than the model's max_position_embeddings ({model.max_positions})"
        )

    inputs: dict[str, Any] = {
        "config": source if isinstance(config, (str, os.PathLike)) else None,
        "params": count,
        "model_type": model.model_type if model else None,
        "mode": mode,
        "dtype": dtype,
        "optimizer": optimizer,
        "batch": batch,
        "seq": seq,
        "gpus": gpus,
        "dp": dp,
        "zero": zero,
        "offload": offload,
        "tp": tp,
        "pp": pp,
        "recompute": recompute,
        "attention": attention,
    }
    opts = _Options(
        mode, dtype, optimizer, batch, seq, dp, zero, offload, tp, pp, recompute, attention
    )

    if model is None:
        assert count is not None
        return _from_count(count, opts, inputs, notes)
    return _from_model(model, opts, inputs, notes)


@dataclass(frozen=True)
class _Options:
    mode: str
    dtype: str
    optimizer: str
    batch: int
    seq: int
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


def _model_states(
    weights: int, gradients: int, optimizer: int, o: _Options
) -> tuple[dict[str, int], dict[str, int]]:
    """ZeRO sharding across ``dp`` and CPU offload; returns (on GPU, on host) per GPU."""

    def shard(nbytes: int, stage: int) -> int:
        return _cdiv(nbytes, o.dp) if o.zero >= stage else nbytes

    gpu = {
        "weights": shard(weights, 3),
        "gradients": shard(gradients, 2),
        "optimizer": shard(optimizer, 1),
    }
    host = dict.fromkeys(HOST_KEYS, 0)
    moved: tuple[str, ...] = ()
    if o.offload == "optimizer":
        # ZeRO-Offload: the optimizer step runs on the CPU; from stage 2 on, the gradient
        # shards it consumes live there too.
        moved = ("optimizer", "gradients") if o.zero >= 2 else ("optimizer",)
    elif o.offload == "all":
        moved = HOST_KEYS
    for key in moved:
        host[key], gpu[key] = gpu[key], 0
    return gpu, host


def _from_count(count: int, o: _Options, inputs: dict[str, Any], notes: list[str]) -> Estimate:
    local = _cdiv(count, o.tp * o.pp)
    if o.tp * o.pp > 1:
        notes.append("parameters are split evenly across tensor and pipeline ranks")
    if o.dtype in _QUANTIZED:
        notes.append(
            f"every parameter counted at {o.dtype}; checkpoints usually keep embeddings and "
            "norms in 16-bit, which --config accounts for"
        )
    if o.train:
        b = _train_bytes_per_param(o.dtype)
        weights, gradients = b * local, b * local
        master = 4 * local if o.dtype != "fp32" else 0
        if o.optimizer == "adamw":
            state = 8 * local
        elif o.optimizer == "adam8bit":
            state = 2 * local + 2 * 4 * _cdiv(local, ADAM8BIT_BLOCK)
        elif o.optimizer == "sgd":
            state = 4 * local
        else:
            state = 0
            notes.append(
                "Adafactor's factored second moments (a row and a column per matrix) need "
                "the matrix shapes: pass --config (counted as 0 here)"
            )
        optimizer = master + state
    else:
        weights, gradients, optimizer = _dtype_bytes(local, o.dtype), 0, 0
    gpu, host = _model_states(weights, gradients, optimizer, o)
    notes.append(
        "activations, logits and KV cache need the model's shape: pass --config "
        "CONFIG.json (counted as 0 here)"
    )
    if o.zero == 3 and o.dp > 1:
        notes.append("the layer ZeRO-3 gathers around its compute needs --config (counted as 0)")
    breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0) | gpu
    return Estimate(
        parameters=count,
        per_gpu_bytes=sum(breakdown.values()),
        breakdown=breakdown,
        host_bytes=sum(host.values()),
        host_breakdown=host,
        active_parameters=count,
        inputs=inputs,
        notes=tuple(notes),
    )


def _stages(model: Model, pp: int) -> list[tuple[list[Layer], list[Tensor]]]:
    """Layers and extra weights of each pipeline stage (earlier stages take the remainder)."""
    n = len(model.layers)
    if pp > n:
        raise EstimateError(f"pp ({pp}) is larger than the number of layers ({n})")
    base, extra = divmod(n, pp)
    stages: list[tuple[list[Layer], list[Tensor]]] = []
    start = 0
    for i in range(pp):
        size = base + (1 if i < extra else 0)
        tensors: list[Tensor] = []
        if i == 0:
            tensors.append(model.embedding)
        if i == pp - 1:
            tensors.append(model.final_norm)
            if model.lm_head is not None:
                tensors.append(model.lm_head)
            elif pp > 1:
                tensors.append(model.embedding)  # tied: the last stage holds its own copy
        stages.append((list(model.layers[start : start + size]), tensors))
        start += size
    return stages


def _from_model(model: Model, o: _Options, inputs: dict[str, Any], notes: list[str]) -> Estimate:
    for layer in {id(layer): layer for layer in model.layers}.values():
        if layer.heads % o.tp:
            raise EstimateError(
                f"tp ({o.tp}) must divide the number of attention heads ({layer.heads})"
            )
    e = _act_bytes(o.dtype)
    best: tuple[int, int, dict[str, int], dict[str, int]] | None = None
    stages = _stages(model, o.pp)
    for index, (layers, extra) in enumerate(stages):
        gpu, host = _stage_bytes(model, layers, extra, index, o, e)
        total = sum(gpu.values())
        if best is None or total > best[0]:
            best = (total, index, gpu, host)
    assert best is not None
    total, index, gpu, host = best
    if o.pp > 1:
        notes.append(
            f"figures are for pipeline stage {index}, the largest of {o.pp} "
            "(1F1B schedule: stage i keeps pp - i micro-batches of activations)"
        )
    return Estimate(
        parameters=model.parameters,
        per_gpu_bytes=total,
        breakdown=gpu,
        host_bytes=sum(host.values()),
        host_breakdown=host,
        active_parameters=model.active_parameters,
        pipeline_stage=index,
        inputs=inputs,
        notes=tuple(notes),
    )


def _stage_bytes(
    model: Model, layers: list[Layer], extra: list[Tensor], index: int, o: _Options, e: int
) -> tuple[dict[str, int], dict[str, int]]:
    tensors = [t for layer in layers for t in layer.tensors] + extra
    local = sum(t.local_numel(o.tp) for t in tensors)
    last = index == o.pp - 1
    tok = o.batch * o.seq

    if o.train:
        b = _train_bytes_per_param(o.dtype)
        weights, gradients = b * local, b * local
        optimizer = 4 * local if o.dtype != "fp32" else 0  # fp32 master weights
        optimizer += sum(
            _optimizer_state(t.local_shape(o.tp), t.copies, o.optimizer) for t in tensors
        )
    else:
        weights, gradients, optimizer = _weight_bytes(tensors, o.tp, o.dtype), 0, 0
    gpu, host = _model_states(weights, gradients, optimizer, o)

    # ZeRO-3 all-gathers a whole layer's weights before computing it (and, in training, holds
    # its full gradients until they are reduce-scattered), as FSDP does per wrapped layer.
    gathered = 0
    if o.zero == 3 and o.dp > 1 and layers:
        if o.train:
            b = _train_bytes_per_param(o.dtype)
            gathered = max(
                2 * b * sum(t.local_numel(o.tp) for t in layer.tensors) for layer in layers
            )
        else:
            gathered = max(_weight_bytes(layer.tensors, o.tp, o.dtype) for layer in layers)

    activations = logits = kv_cache = 0
    h = model.hidden
    if o.train and layers:
        inflight = o.pp - index
        terms = [
            train_layer_activations(layer, h, o.batch, o.seq, e, o.tp, o.attention)
            for layer in layers
        ]
        layer_input = _cdiv(e * tok * h, o.tp)
        if o.recompute == "none":
            activations = inflight * sum(lin + quad for lin, quad in terms)
        elif o.recompute == "selective":
            # Recompute the attention core (the s^2 terms), one layer at a time in backward.
            activations = inflight * sum(lin for lin, _ in terms) + max(q for _, q in terms)
        else:
            # Keep each layer's input; the layer being back-propagated is rematerialised whole.
            activations = inflight * layer_input * len(layers) + max(lin + q for lin, q in terms)
        if last:
            activations += 2 * layer_input  # inputs of the final norm and of the output layer
            # The output layer's logits, their fp32 copy for the loss and the fp32 log-softmax
            # the cross-entropy keeps for backward.
            # 16-bit logits get an fp32 copy for the loss; fp32 logits are used as they are.
            fp32_copy = 4 if e < 4 else 0
            logits = (e + fp32_copy + 4) * tok * _cdiv(model.vocab, o.tp)
    elif layers or last:
        if layers:
            activations = max(
                inference_layer_activations(layer, h, o.batch, o.seq, e, o.tp, o.attention)
                for layer in layers
            )
            kv_cache = sum(_kv_cache_bytes(layer, o.batch, o.seq, e, o.tp) for layer in layers)
        if o.attention == "eager":
            activations += e * o.batch * o.seq * o.seq  # the 4-D causal mask
        if last:
            logits = e * tok * model.vocab  # a forward pass returns logits for every position

    gpu |= {
        "activations": activations,
        "logits": logits,
        "kv_cache": kv_cache,
        "zero3_gathered": gathered,
    }
    return {key: gpu[key] for key in BREAKDOWN_KEYS}, host


# --------------------------------------------------------------------------------------------
# Command line

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
    add("--params", metavar="N", help="a parameter count instead of a config: 7e9, 7B")
    add("--mode", metavar="{inference,train}", default="inference", help="default: inference")
    add("--dtype", metavar="{" + ",".join(DTYPES) + "}", default="bf16", help="default: bf16")
    add(
        "--optimizer",
        metavar="{" + ",".join(OPTIMIZERS) + "}",
        default="adamw",
        help="training only; default: adamw",
    )
    add("--batch", metavar="B", default="1", help="sequences per data-parallel rank; default: 1")
    add(
        "--seq",
        metavar="S",
        default=None,
        help="tokens per sequence; default: 2048 (less if max_position_embeddings is)",
    )
    add("--gpus", metavar="N", default="1", help="total GPUs; default: 1")
    add("--zero", metavar="{0,1,2,3}", default="0", help="ZeRO stage; default: 0")
    add(
        "--offload",
        metavar="{" + ",".join(OFFLOADS) + "}",
        default="none",
        help="CPU offload of ZeRO shards; default: none",
    )
    add("--tp", metavar="N", default="1", help="tensor-parallel degree; default: 1")
    add("--pp", metavar="N", default="1", help="pipeline-parallel degree; default: 1")
    add(
        "--recompute",
        metavar="{" + ",".join(RECOMPUTES) + "}",
        default="none",
        help="activation recomputation (training); default: none",
    )
    add(
        "--attention",
        metavar="{" + ",".join(ATTENTIONS) + "}",
        default="flash",
        help="flash never materialises the s x s scores; default: flash",
    )
    add("--json", action="store_true", help="print one JSON object instead of a table")
    parser.set_defaults(run=_run)
    return parser


def _int_option(option: str, value: str | None) -> int | None:
    if value is None:
        return None
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        raise EstimateError(f"{option} must be a positive integer; got {value!r}")
    return int(text)


def _run(args: argparse.Namespace) -> int:
    try:
        if (args.config is None) == (args.params is None):
            raise EstimateError("give exactly one of --config CONFIG.json or --params N")
        zero_text = str(args.zero).strip()
        if zero_text not in ("0", "1", "2", "3"):
            raise EstimateError(f"--zero must be one of 0, 1, 2, 3; got {args.zero!r}")
        for option, value, choices in (
            ("--mode", args.mode, MODES),
            ("--dtype", args.dtype, DTYPES),
            ("--optimizer", args.optimizer, OPTIMIZERS),
            ("--offload", args.offload, OFFLOADS),
            ("--recompute", args.recompute, RECOMPUTES),
            ("--attention", args.attention, ATTENTIONS),
        ):
            _choice(option, value, choices)
        params = parse_count(args.params, "--params") if args.params is not None else None
        result = estimate(
            params=params,
            config=args.config,
            mode=args.mode,
            dtype=args.dtype,
            optimizer=args.optimizer,
            batch=_int_option("--batch", args.batch),
            seq=_int_option("--seq", args.seq),
            gpus=_int_option("--gpus", args.gpus),
            zero=int(zero_text),
            offload=args.offload,
            tp=_int_option("--tp", args.tp),
            pp=_int_option("--pp", args.pp),
            recompute=args.recompute,
            attention=args.attention,
        )
    except EstimateError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(result.format())
    return 0
