"""The bytes of each term: weights per dtype, optimizer states, activations and KV cache.

Model states follow Rajbhandari et al. (2020), section 3.1; activations Korthikanti et al.
(2022), sections 4.1-4.3, generalised term by term to GQA, gated MLPs, MoE and MLA.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from fractions import Fraction

from pytest_vram.estimate.model import Layer, Tensor, cdiv
from pytest_vram.estimate.options import QUANTIZED

# int4 checkpoints (GPTQ, AWQ) store, per group of 128 input weights, one fp16 scale and one
# 4-bit zero point: 2.5 bytes on top of the 64 bytes of packed weights.
INT4_GROUP_SIZE = 128
# bitsandbytes 8-bit optimizers: block-wise quantised states with one fp32 absmax per block
# of 256 values; tensors under 4096 elements keep 32-bit states.
ADAM8BIT_BLOCK = 256
ADAM8BIT_MIN_SIZE = 4096


def _int4_bytes(numel: int, in_features: int | None = None) -> int:
    if in_features:
        groups = numel // in_features * cdiv(in_features, INT4_GROUP_SIZE)
    else:
        groups = cdiv(numel, INT4_GROUP_SIZE)
    return cdiv(numel, 2) + 2 * groups + cdiv(groups, 2)


def dtype_bytes(numel: int, dtype: str, in_features: int | None = None) -> int:
    if dtype == "fp32":
        return 4 * numel
    if dtype in ("fp16", "bf16"):
        return 2 * numel
    if dtype in ("fp8", "int8"):
        return numel  # per-tensor or per-channel scales: well under 0.1%, not counted
    return _int4_bytes(numel, in_features)


def weight_bytes(tensors: Iterable[Tensor], tp: int, dtype: str) -> int:
    total = 0
    for t in tensors:
        shape = t.local_shape(tp)
        numel = math.prod(shape) * t.copies
        if dtype in QUANTIZED and not t.quantized:
            total += 2 * numel  # embeddings, norms, biases, routers stay in bf16
        else:
            in_features = shape[-1] if len(shape) == 2 else None
            total += dtype_bytes(numel, dtype, in_features)
    return total


def _adam8bit_state(numel: int) -> int:
    if numel < ADAM8BIT_MIN_SIZE:
        return 8 * numel
    return 2 * numel + 2 * 4 * cdiv(numel, ADAM8BIT_BLOCK)


def optimizer_state(shape: tuple[int, ...], copies: int, optimizer: str) -> int:
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


def train_bytes_per_param(dtype: str) -> int:
    return 4 if dtype == "fp32" else 2


def act_bytes(dtype: str) -> int:
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
    g = cdiv(layer.kv_heads, tp)  # KV heads are replicated when there are fewer than ranks
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
    return cdiv(lin), cdiv(quad)


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
    g = cdiv(layer.kv_heads, tp)  # KV heads are replicated when there are fewer than ranks
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
    return cdiv(base + max(attn, mlp))


def kv_cache_bytes(layer: Layer, batch: int, seq: int, e: int, tp: int) -> int:
    tokens = min(seq, layer.window) if layer.window else seq
    if layer.kv_lora_rank:
        # MLA caches the compressed latent and the shared RoPE key, replicated on TP ranks.
        width = layer.kv_lora_rank + layer.rope_head_dim
    else:
        width = cdiv(layer.kv_heads, tp) * (layer.qk_head_dim + layer.v_head_dim)
    return width * tokens * batch * e


def count_optimizer_bytes(numel: int, dtype: str, optimizer: str) -> int:
    """fp32 master weights and optimizer state of ``numel`` parameters whose shapes are unknown.

    Adafactor's factored second moments need the matrix shapes, so they count as 0 here.
    """
    master = 4 * numel if dtype != "fp32" else 0
    if optimizer == "adamw":
        state = 8 * numel
    elif optimizer == "adam8bit":
        # Without shapes no tensor is known to be small enough to keep 32-bit states.
        state = 2 * numel + 2 * 4 * cdiv(numel, ADAM8BIT_BLOCK)
    elif optimizer == "sgd":
        state = 4 * numel
    else:
        state = 0
    return master + state
