"""A model's weights and shapes: the structure, the per-family builders, parameter counts."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from pytest_vram.estimate.config import check_family, load_config, opt_int, pos_int
from pytest_vram.estimate.options import EstimateError


def cdiv(a: int | Fraction, b: int = 1) -> int:
    """Ceiling division that stays exact for ints and fractions: a rank's share of a split."""
    return math.ceil(Fraction(a) / b)


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
        shape[self.split] = cdiv(shape[self.split] // self.unit, tp) * self.unit
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


def model_from_config(cfg: Mapping[str, Any], source: str = "config") -> Model:
    """Build a :class:`Model` from a Hugging Face config dict; :class:`EstimateError` if the
    architecture is unknown or the config lacks keys its parameter count needs."""
    if check_family(cfg, source).startswith("deepseek"):
        return _deepseek(cfg, source)
    return _llama_like(cfg, source)


def count_parameters(config: str | os.PathLike[str] | Mapping[str, Any]) -> int:
    """The parameter count of the model a config.json (path or dict) describes."""
    return resolve_model(config)[0].parameters


def resolve_model(config: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[Model, str]:
    """The model of a config.json path or dict, and the name its messages use for it."""
    if isinstance(config, Mapping):
        return model_from_config(config, "config"), "config"
    if isinstance(config, (str, os.PathLike)):
        source = os.fspath(config)
        return model_from_config(load_config(source), source), source
    raise EstimateError(f"config must be a path or a dict, got {type(config).__name__}")


def _windows(cfg: Mapping[str, Any], n_layers: int, source: str) -> list[int | None]:
    """Per layer, the sliding window its attention (and so its KV cache) is limited to."""
    model_type = cfg["model_type"]
    window = cfg.get("sliding_window")
    if window is not None:
        window = pos_int(cfg, "sliding_window", source)
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
    hidden = pos_int(cfg, "hidden_size", source)
    n_layers = pos_int(cfg, "num_hidden_layers", source)
    heads = pos_int(cfg, "num_attention_heads", source)
    kv_heads = pos_int(cfg, "num_key_value_heads", source, heads)
    head_dim = pos_int(cfg, "head_dim", source, hidden // heads)
    ffn = pos_int(cfg, "intermediate_size", source)
    vocab = pos_int(cfg, "vocab_size", source)
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
        experts = pos_int(cfg, "num_local_experts", source)
        top_k = pos_int(cfg, "num_experts_per_tok", source)
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
    hidden = pos_int(cfg, "hidden_size", source)
    n_layers = pos_int(cfg, "num_hidden_layers", source)
    heads = pos_int(cfg, "num_attention_heads", source)
    ffn = pos_int(cfg, "intermediate_size", source)
    vocab = pos_int(cfg, "vocab_size", source)
    tied = bool(cfg.get("tie_word_embeddings", False))
    q_lora = opt_int(cfg, "q_lora_rank", source)
    kv_lora = pos_int(cfg, "kv_lora_rank", source)
    nope = pos_int(cfg, "qk_nope_head_dim", source)
    rope = pos_int(cfg, "qk_rope_head_dim", source)
    v_dim = pos_int(cfg, "v_head_dim", source)
    moe_ffn = pos_int(cfg, "moe_intermediate_size", source)
    n_routed = pos_int(cfg, "n_routed_experts", source)
    n_shared = opt_int(cfg, "n_shared_experts", source)
    top_k = pos_int(cfg, "num_experts_per_tok", source)
    first_dense = opt_int(cfg, "first_k_dense_replace", source)
    moe_freq = pos_int(cfg, "moe_layer_freq", source, 1)
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
