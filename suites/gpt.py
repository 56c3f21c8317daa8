"""A small decoder-only transformer, written out so the suites need no downloads.

Llama/Qwen-shaped: RMSNorm, grouped-query attention through ``scaled_dot_product_attention``,
a SwiGLU MLP, rotary position embeddings, untied or tied embeddings, optional activation
checkpointing per block, and a KV cache for generation. ``GPTConfig.qwen2_5_32b()`` is the
32B shape the simulated-device suites train.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 1024
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 2
    ffn_size: int = 704
    max_seq_len: int = 512
    tie_embeddings: bool = False
    qkv_bias: bool = False
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @classmethod
    def qwen2_5_32b(cls) -> GPTConfig:
        """Qwen2.5-32B's shape: 32,763,876,352 parameters."""
        return cls(
            vocab_size=152064,
            hidden_size=5120,
            num_layers=64,
            num_heads=40,
            num_kv_heads=8,
            ffn_size=27648,
            max_seq_len=32768,
            qkv_bias=True,
            rope_theta=1000000.0,
        )


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype) * self.weight


def rotary_tables(
    config: GPTConfig, positions: torch.Tensor, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    half = config.head_dim // 2
    inv_freq = 1.0 / (
        config.rope_theta
        ** (torch.arange(0, half, dtype=torch.float32, device=positions.device) / half)
    )
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)


class KVCache:
    """Preallocated keys and values for every layer: batch x kv_heads x max_len x head_dim."""

    def __init__(
        self,
        config: GPTConfig,
        batch: int,
        max_len: int,
        device: torch.device | str,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (config.num_layers, batch, config.num_kv_heads, max_len, config.head_dim)
        self.keys = torch.zeros(shape, device=device, dtype=dtype)
        self.values = torch.zeros(shape, device=device, dtype=dtype)
        self.length = 0

    @property
    def nbytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        kv_size = config.num_kv_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=config.qkv_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        cache: KVCache | None = None,
        layer: int = 0,
    ) -> torch.Tensor:
        batch, seq, _ = x.shape
        c = self.config
        # Heads as -1: under tensor parallelism each rank holds a slice of them.
        q = self.q_proj(x).view(batch, seq, -1, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, -1, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, -1, c.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            start = cache.length
            cache.keys[layer, :, :, start : start + seq] = k
            cache.values[layer, :, :, start : start + seq] = v
            k = cache.keys[layer, :, :, : start + seq]
            v = cache.values[layer, :, :, : start + seq]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=cache is None or seq > 1, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.ffn_size, bias=False)
        self.down_proj = nn.Linear(config.ffn_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size)
        self.attention = Attention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, cache=None, layer=0):
        x = x + self.attention(self.input_norm(x), cos, sin, cache, layer)
        return x + self.mlp(self.post_attention_norm(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, checkpointing: bool = False) -> None:
        super().__init__()
        self.config = config
        self.checkpointing = checkpointing
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        start = cache.length if cache is not None else 0
        positions = torch.arange(start, start + tokens.shape[1], device=tokens.device)
        x = self.embed(tokens)
        cos, sin = rotary_tables(self.config, positions, x.dtype)
        for layer, block in enumerate(self.blocks):
            if self.checkpointing and self.training and cache is None:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin, cache, layer)
        if cache is not None:
            cache.length += tokens.shape[1]
        return self.lm_head(self.norm(x))

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self(tokens)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Build a model's parameters directly in ``dtype``, as large models are loaded."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def parameter_count(model: nn.Module) -> int:
    """Parameters, each counted once (tied embeddings share one tensor)."""
    return sum(p.numel() for p in model.parameters())


def training_step(
    model: GPT, optimizer: torch.optim.Optimizer, tokens: torch.Tensor, targets: torch.Tensor
) -> None:
    """Forward, backward, optimizer step, and zero_grad(set_to_none=True)."""
    loss = model.loss(tokens, targets)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


@torch.no_grad()
def generate(model: GPT, prompt: torch.Tensor, new_tokens: int, cache: KVCache) -> torch.Tensor:
    """Greedy decoding with a KV cache: one prefill, then one token at a time."""
    logits = model(prompt, cache)
    token = logits[:, -1:].argmax(-1)
    out = [token]
    for _ in range(new_tokens - 1):
        token = model(token, cache)[:, -1:].argmax(-1)
        out.append(token)
    return torch.cat(out, dim=1)
