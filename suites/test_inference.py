"""Generation with a KV cache: the cache is sized up front, and decoding must not grow it."""

import torch
from gpt import GPT, GPTConfig, KVCache, generate

from pytest_vram import max_vram

CONFIG = GPTConfig(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=2)
BATCH, PROMPT, NEW_TOKENS = 8, 64, 32


def kv_cache_bytes(config: GPTConfig, batch: int, tokens: int, bytes_per_value: int = 4) -> int:
    """Keys and values for every layer: 2 x layers x batch x kv_heads x tokens x head_dim."""
    return (
        2 * config.num_layers * batch * config.num_kv_heads * tokens * config.head_dim
    ) * bytes_per_value


# fp32 weights (13.4 MB) + the cache (1.6 MB) + one prefill's activations and logits (~10 MB),
# and the cuBLAS workspace of the first matmul: 32 MiB (33.6 MB) on Hopper, on a GPU as on sim.
@max_vram("72MB")
def test_generation_with_kv_cache(vram):
    torch.manual_seed(0)
    model = GPT(CONFIG).to(vram.device).eval()
    prompt = torch.randint(0, CONFIG.vocab_size, (BATCH, PROMPT), device=vram.device)
    with vram.measure() as allocation:
        cache = KVCache(CONFIG, BATCH, PROMPT + NEW_TOKENS, vram.device)
    assert cache.nbytes == kv_cache_bytes(CONFIG, BATCH, PROMPT + NEW_TOKENS)
    assert allocation.end - allocation.start == cache.nbytes

    # The test's first matmul allocates cuBLAS's workspace, which decoding does not keep.
    probe = torch.ones(1, 1, device=vram.device)
    probe @ probe
    with vram.measure() as decoding:
        tokens = generate(model, prompt, NEW_TOKENS, cache)
    assert tokens.shape == (BATCH, NEW_TOKENS)
    # Decoding writes into the preallocated cache: nothing stays behind but the output.
    assert decoding.end - decoding.start <= tokens.nbytes + 512 * NEW_TOKENS


def test_decoding_does_not_leak(vram):
    model = GPT(CONFIG).to(vram.device).eval()
    cache = KVCache(CONFIG, 1, 512, vram.device)
    token = torch.zeros(1, 1, dtype=torch.long, device=vram.device)

    def decode_one():
        with torch.no_grad():
            model(token, cache)

    # Each step appends one token to the cache: a cache that grew instead of filling its
    # preallocated room would show within the check's 20 steps.
    vram.leak_check(decode_one, steps=20, warmup=3)
    assert cache.length == 23
