"""The memory-saving recipes the recipe suites measure, written with torch alone.

- ``HostAdamW``: AdamW whose fp32 master weights and moments live in host memory (ZeRO-Offload's
  split): the device keeps the bf16 weights and gradients, and each step copies the gradients
  to the host, updates there and copies the new weights back.
- ``QuantizedLinear``: weight-only quantization for inference, int8 (one byte a weight) or int4
  (two weights packed in one uint8 byte), with one scale per output channel; the weight is
  dequantized on the fly, one layer at a time.
- ``checkpoint_feed_forward``: selective activation checkpointing, the feed-forward blocks only.
- ``serving_step``: a KV cache for the whole context and one prefill, the memory a server needs
  for a batch of requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from gpt import GPT, GPTConfig, KVCache, default_dtype
from torch import nn
from torch.utils.checkpoint import checkpoint

# A 4.5B model of the same family (36 layers of hidden 3072, 24 heads, 8 KV heads), the size
# the articles say one A100 MIG slice runs: 4,558,568,448 parameters.
CONFIG_4_5B = GPTConfig(
    vocab_size=152064,
    hidden_size=3072,
    num_layers=36,
    num_heads=24,
    num_kv_heads=8,
    ffn_size=8192,
    max_seq_len=32768,
    qkv_bias=True,
    rope_theta=1000000.0,
)

# The context a served request holds: a 2048-token prompt and up to 2048 generated tokens.
PROMPT, CONTEXT = 2048, 4096


def local(tensor: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
    """This rank's shard of a DTensor (tensor parallel), laid out as ``like`` is, or the
    tensor itself."""
    if not hasattr(tensor, "to_local"):
        return tensor
    if like is not None and tensor.placements != like.placements:
        tensor = tensor.redistribute(like.device_mesh, like.placements)
    return tensor.to_local()


class HostAdamW(torch.optim.Optimizer):
    """AdamW with fp32 master weights and moments in host memory.

    The host buffers are made without a device (pinned, as an offloading optimizer makes them
    for fast copies): on a GPU they are host memory, and the simulated device does not count
    them either. What stays on the device is what the model holds: its bf16 weights, and its
    gradients until the step has copied them to the host and let them go.
    """

    def __init__(self, params, lr=1e-5, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):  # type: ignore[no-untyped-def]
        super().__init__(
            params, {"lr": lr, "betas": betas, "eps": eps, "weight_decay": weight_decay}
        )

    @torch.no_grad()
    def step(self) -> None:  # type: ignore[override]
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                weight = local(param)
                state = self.state[param]
                if not state:
                    state["step"] = 0
                    state["master"] = torch.empty(weight.shape, pin_memory=True)
                    state["master"].copy_(weight)
                    state["exp_avg"] = torch.zeros(weight.shape, pin_memory=True)
                    state["exp_avg_sq"] = torch.zeros(weight.shape, pin_memory=True)
                state["step"] += 1
                grad = torch.empty(weight.shape, pin_memory=True)
                grad.copy_(local(param.grad, like=param))
                param.grad = None
                master, exp_avg, exp_avg_sq = state["master"], state["exp_avg"], state["exp_avg_sq"]
                master.mul_(1 - group["lr"] * group["weight_decay"])
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                bias1, bias2 = 1 - beta1 ** state["step"], 1 - beta2 ** state["step"]
                denom = (exp_avg_sq / bias2).sqrt_().add_(group["eps"])
                master.addcdiv_(exp_avg, denom, value=-group["lr"] / bias1)
                weight.copy_(master)


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is stored in ``bits`` (8 or 4) with a scale per output
    channel, and dequantized to the activations' dtype for each matrix multiply."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, bits: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        if bits not in (8, 4):
            raise ValueError(f"bits must be 8 or 4, got {bits}")
        self.in_features, self.out_features, self.bits = in_features, out_features, bits
        if bits == 8:
            self.register_buffer("weight", torch.empty(out_features, in_features, dtype=torch.int8))
        else:
            packed = (out_features, in_features // 2)
            self.register_buffer("weight", torch.empty(packed, dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(out_features, 1, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        if self.bits == 8:
            return self.weight.to(dtype) * self.scale
        # Two 4-bit values a byte, low nibble first, stored with an offset of 8.
        low, high = self.weight & 0x0F, self.weight >> 4
        values = torch.stack((low, high), dim=-1).view(self.out_features, self.in_features)
        return (values.to(dtype) - 8) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantized(x.dtype), self.bias)


# Under tensor parallelism (Megatron's split): these layers keep a slice of their outputs...
COLUMNWISE = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head")
# ...and these a slice of their inputs, their partial outputs summed across the ranks.
ROWWISE = ("o_proj", "down_proj")


class AllReduced(nn.Module):
    """A row-wise layer's partial output, summed in place across the tensor-parallel ranks."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        torch.distributed.all_reduce(out)
        return out


def quantized_gpt(config: GPTConfig, bits: int, device: torch.device | str, ranks: int = 1) -> GPT:
    """The GPT with every linear layer (the output layer too) quantized to ``bits``, as one of
    ``ranks`` tensor-parallel ranks holds it; the embedding and the norms stay bf16 and whole.
    Built as shapes, then materialised on the device, so the bf16 weights never exist."""
    with default_dtype(torch.bfloat16), torch.device("meta"):
        model = GPT(config)
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if not isinstance(child, nn.Linear):
                    continue
                inputs, outputs = child.in_features, child.out_features
                if name in ROWWISE:
                    inputs //= ranks
                else:
                    outputs //= ranks
                layer = QuantizedLinear(
                    inputs, outputs, child.bias is not None, bits, torch.bfloat16
                )
                setattr(module, name, AllReduced(layer) if name in ROWWISE and ranks > 1 else layer)
    return model.to_empty(device=device)


def weight_bytes(model: nn.Module) -> int:
    """What the model's parameters and buffers hold: the weights a server keeps resident."""
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(local(t).nbytes for t in tensors)


class Checkpointed(nn.Module):
    """Runs ``inner`` under activation checkpointing: only its inputs are kept for backward."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.inner, *args, use_reentrant=False)


@contextlib.contextmanager
def checkpoint_feed_forward(model: GPT) -> Iterator[None]:
    """Selective checkpointing: each block's feed-forward (SwiGLU) recomputed in backward, its
    attention's activations kept."""
    mlps = [block.mlp for block in model.blocks]
    for block, mlp in zip(model.blocks, mlps, strict=True):
        block.mlp = Checkpointed(mlp)
    try:
        yield
    finally:
        for block, mlp in zip(model.blocks, mlps, strict=True):
            block.mlp = mlp


def serving_step(model: GPT, config: GPTConfig, batch: int, device: torch.device | str) -> None:
    """A batch of requests: their KV cache for the whole context, then the prompts' prefill.

    ``config`` is the shape of this rank's cache (under tensor parallelism, its KV heads)."""
    cache = KVCache(config, batch, CONTEXT, device, dtype=torch.bfloat16)
    prompts = torch.randint(0, config.vocab_size, (batch, PROMPT), device=device)
    with torch.no_grad():
        model(prompts, cache)


def shard_config(config: GPTConfig, ranks: int) -> GPTConfig:
    """The shape one of ``ranks`` tensor-parallel ranks holds of heads and feed-forward."""
    return dataclasses.replace(config, num_kv_heads=config.num_kv_heads // ranks)


def serve_4_5b(layout) -> Callable[[int], None]:  # type: ignore[no-untyped-def]
    """``pytest-vram fit --build recipes:serve_4_5b``: the 4.5B model served in bf16."""
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = GPT(CONFIG_4_5B).eval()
    return lambda batch: serving_step(model, CONFIG_4_5B, batch, "cuda")


def serve_32b(layout) -> Callable[[int], None]:  # type: ignore[no-untyped-def]
    """``pytest-vram fit --build recipes:serve_32b``: the 32B model served in bf16."""
    config = GPTConfig.qwen2_5_32b()
    with default_dtype(torch.bfloat16), torch.device("cuda"):
        model = GPT(config).eval()
    return lambda batch: serving_step(model, config, batch, "cuda")
