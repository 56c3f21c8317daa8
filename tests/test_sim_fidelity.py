"""The shape-only simulated device against real CPU runs of the same code.

Each case runs once shape-only (fake tensors) and once computing (``use_values(True)``: real CPU
tensors, counted by the same tracker), and the two peaks must agree: where they do not,
shape-only code took a path a real run does not take. Models are built from transformers
configs (no weights), small enough that the computing run takes seconds.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from simulated_device import simulated
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor

from pytest_vram.backends.sim.backend import SimBackend

transformers = pytest.importorskip("transformers")

Run = Callable[[SimBackend], None]


def peaks(run: Run) -> tuple[int, int]:
    """The peak allocated bytes of ``run`` shape-only and computing."""
    figures = []
    for computing in (False, True):
        torch.manual_seed(0)
        with simulated(computing) as backend:
            run(backend)
            figures.append(backend.peak_allocated())
    return figures[0], figures[1]


def assert_agrees(run: Run, tolerance: float = 0.01) -> tuple[int, int]:
    shape_only, computed = peaks(run)
    assert computed > 0
    assert abs(shape_only - computed) <= tolerance * computed, (shape_only, computed)
    return shape_only, computed


# -- the panel --------------------------------------------------------------------------------


def _decoder(config: object, model_class: type, tokens: int = 64, **inputs: object) -> Run:
    """A training step (forward, backward, AdamW) and an inference forward."""

    def run(backend: SimBackend) -> None:
        with torch.device("cuda"):
            model = model_class(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, config.vocab_size, (2, tokens), device="cuda")
        model(input_ids=ids, labels=ids, **inputs).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        model.eval()
        with torch.no_grad():
            model(input_ids=ids)

    return run


def gpt2() -> Run:
    config = transformers.GPT2Config(
        vocab_size=512, n_positions=128, n_embd=64, n_layer=2, n_head=4,
        attn_implementation="sdpa",
    )  # fmt: skip
    return _decoder(config, transformers.GPT2LMHeadModel)


def llama() -> Run:
    config = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    return _decoder(config, transformers.LlamaForCausalLM)


def mistral() -> Run:
    config = transformers.MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=32,
        attn_implementation="sdpa",
    )  # fmt: skip
    return _decoder(config, transformers.MistralForCausalLM)


def _mixtral_config() -> object:
    return transformers.MixtralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, attn_implementation="sdpa",
    )  # fmt: skip


def mixtral() -> Run:
    return _decoder(_mixtral_config(), transformers.MixtralForCausalLM)


def skip_if_the_experts_need_values() -> None:
    """Skip where Mixtral's backward reads values: on a torch without ``_grouped_mm`` (before
    2.8), older transformers run the experts' backward one expert at a time after
    ``offs.tolist()``, which a shape-only run cannot answer (a user's test computes then)."""
    if hasattr(torch.ops.aten, "_grouped_mm"):
        return
    try:
        from transformers.integrations import moe
    except ImportError:
        return
    if hasattr(moe, "_grouped_mm_fallback") and not hasattr(
        moe, "_grouped_mm_fallback_backward_fake"
    ):
        pytest.skip(
            f"transformers {transformers.__version__} on torch {torch.__version__}: Mixtral's "
            "experts read their offsets in the backward"
        )


def bert() -> Run:
    config = transformers.BertConfig(
        vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128, attn_implementation="sdpa",
    )  # fmt: skip

    def run(backend: SimBackend) -> None:
        with torch.device("cuda"):
            model = transformers.BertForMaskedLM(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
        mask = torch.ones_like(ids)  # what a tokenizer gives for unpadded input
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        optimizer.step()

    return run


def t5() -> Run:
    config = transformers.T5Config(
        vocab_size=512, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0,
    )  # fmt: skip

    def run(backend: SimBackend) -> None:
        with torch.device("cuda"):
            model = transformers.T5ForConditionalGeneration(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(1, config.vocab_size, (2, 64), device="cuda")
        labels = torch.randint(1, config.vocab_size, (2, 32), device="cuda")
        mask = torch.ones_like(ids)
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        optimizer.step()

    return run


def vit() -> Run:
    config = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=64, patch_size=16, num_labels=10, attn_implementation="sdpa",
    )  # fmt: skip

    def run(backend: SimBackend) -> None:
        with torch.device("cuda"):
            model = transformers.ViTForImageClassification(config)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        pixels = torch.randn(4, 3, 64, 64, device="cuda")
        labels = torch.randint(0, 10, (4,), device="cuda")
        model(pixel_values=pixels, labels=labels).loss.backward()
        optimizer.step()

    return run


def convnet() -> Run:
    def run(backend: SimBackend) -> None:
        with torch.device("cuda"):
            model = nn.Sequential(
                nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64),
                nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
            )  # fmt: skip
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        images = torch.randn(8, 3, 64, 64, device="cuda")
        labels = torch.randint(0, 10, (8,), device="cuda")
        nn.functional.cross_entropy(model(images), labels).backward()
        optimizer.step()

    return run


PANEL: dict[str, Callable[[], Run]] = {
    "gpt2": gpt2,
    "bert": bert,
    "t5": t5,
    "llama": llama,
    "mistral": mistral,
    "mixtral": mixtral,
    "vit": vit,
    "convnet": convnet,
}
_HEAVY = {"t5", "mixtral"}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow) if n in _HEAVY else n for n in PANEL]
)
def test_shape_only_agrees_with_a_computing_run(name: str) -> None:
    if name == "mixtral":
        skip_if_the_experts_need_values()
    assert_agrees(PANEL[name]())


# -- transformers' causal mask: a real run skips it -------------------------------------------


def _long_llama(**inputs: object) -> Callable[[bool], Run]:
    config = transformers.LlamaConfig(
        vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        attn_implementation="sdpa",
    )  # fmt: skip

    def make(checkpointing: bool) -> Run:
        def run(backend: SimBackend) -> None:
            with torch.device("cuda"):
                model = transformers.LlamaForCausalLM(config)
            if checkpointing:
                model.gradient_checkpointing_enable()
                model.train()
            ids = torch.randint(0, config.vocab_size, (1, 4096), device="cuda")
            extra = dict(inputs)
            if extra.pop("ones_mask", False):
                extra["attention_mask"] = torch.ones_like(ids)
            model(input_ids=ids, labels=ids, **extra).loss.backward()

        return run

    return make


@pytest.mark.slow
@pytest.mark.parametrize(
    "inputs",
    [{"use_cache": False}, {"ones_mask": True}, {}],
    ids=["use_cache=False", "all-ones attention_mask", "default"],
)
@pytest.mark.parametrize("checkpointing", [False, True], ids=["", "checkpointing"])
def test_llama_4096_tokens_builds_no_causal_mask(inputs: dict, checkpointing: bool) -> None:
    # A float32 (1, 1, 4096, 4096) mask is 64 MiB; shape-only used to make it (+70%).
    shape_only, computed = peaks(_long_llama(**inputs)(checkpointing))
    assert shape_only == computed


def test_a_mask_with_padding_is_not_taken_for_all_ones() -> None:
    # One padded token: a real run makes the explicit mask, and so does shape-only.
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attn_implementation="sdpa",
    )  # fmt: skip

    def run(backend: SimBackend) -> None:
        with torch.device("cuda"):
            model = transformers.LlamaForCausalLM(config)
        ids = torch.randint(0, 256, (2, 256), device="cuda")
        mask = torch.ones_like(ids)
        mask[1, :8] = 0  # a write: the mask is no longer known to be all ones
        model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()

    with simulated(False) as backend, pytest.raises(RuntimeError) as raised:
        run(backend)
    assert backend.explain_error(raised.value) is not None  # it needs the mask's values
    with simulated(True) as backend:
        run(backend)


def test_transformers_imported_during_the_test_is_answered_too() -> None:
    import sys

    from pytest_vram.backends.sim import fakecuda

    saved = sys.modules.pop(fakecuda._TRANSFORMERS_IMPORT_UTILS)
    try:
        with simulated(False):
            import transformers.utils.import_utils as reimported

            assert reimported.is_tracing(torch.ones(2)) is False
        assert reimported.is_tracing(torch.ones(2)) is False  # real tensors, after the test
        assert reimported.is_fake_tensor is not fakecuda._not_a_fake_tensor
    finally:
        sys.modules[fakecuda._TRANSFORMERS_IMPORT_UTILS] = saved


# -- known values: sound, and forgotten on writes ---------------------------------------------


def test_known_values_answer_like_a_real_run() -> None:
    with simulated(False):
        mask = torch.ones(16, 4096, device="cuda", dtype=torch.long)
        assert isinstance(mask, FakeTensor)
        assert bool(mask.bool().all())
        assert (mask.sum() == mask.numel()).item()
        positions = torch.arange(4096, device="cuda").unsqueeze(0)
        assert int(positions[0, -1]) == 4095
        assert not bool((torch.diff(positions) != 1).any())
        huge = torch.zeros(1 << 30, device="cuda")  # one value: known at any size
        assert not bool((huge != 0).any())
        view = mask[3]
        view[7] = 0  # a write through a view: the whole storage is forgotten
        with pytest.raises(RuntimeError):
            bool(mask.all())
        with pytest.raises(RuntimeError):
            bool(torch.randn(4, device="cuda").sum() > 0)


def test_normal_bounds_decide_trunc_normal_only_when_they_can() -> None:
    with simulated(False):
        weight = torch.empty(1024, 1024, device="cuda")
        nn.init.trunc_normal_(weight, std=0.02)  # bounds at 100 standard deviations
        narrow = torch.empty(1024, device="cuda").normal_()
        with pytest.raises(RuntimeError):
            bool(((narrow < -2) | (narrow > 2)).any())  # +-2 std: unknown
        # trunc_normal_ itself then redraws as often as a real run most likely does
        # (tests/test_sim_parity.py).


# -- Mixtral's experts in float32 and under autocast ------------------------------------------


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "autocast-bf16"])
def test_mixtral_grouped_experts_run_shape_only(autocast: bool) -> None:
    skip_if_the_experts_need_values()
    config = _mixtral_config()

    def run(backend: SimBackend) -> None:
        with torch.device("cuda"):
            model = transformers.MixtralForCausalLM(config)
        ids = torch.randint(0, config.vocab_size, (2, 64), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    shape_only, computed = peaks(run)
    assert shape_only == computed


# -- ViT builds shape-only --------------------------------------------------------------------


def test_vit_builds_shape_only_with_the_real_figures() -> None:
    config = transformers.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        image_size=64, patch_size=16,
    )  # fmt: skip

    def run(backend: SimBackend) -> None:
        with torch.device("cuda"):
            transformers.ViTModel(config)

    shape_only, computed = peaks(run)
    assert shape_only == computed > 0


# -- AdamW's step counters are host memory ----------------------------------------------------


@pytest.mark.parametrize("computing", [False, True], ids=["shape-only", "computing"])
@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "for-loop"])
def test_adamw_step_counters_are_not_device_memory(computing: bool, foreach: bool) -> None:
    with simulated(computing) as backend:
        with torch.device("cuda"):
            model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(100)])  # 200 tensors
        optimizer = torch.optim.AdamW(model.parameters(), foreach=foreach)
        model(torch.randn(2, 8, device="cuda")).sum().backward()
        optimizer.step()
        # Every parameter tensor is under 512 bytes: each is one 512-byte block, and so is
        # each gradient and moment. The 200 step counters (0-d float32) are host memory.
        assert backend.allocated() == 4 * 200 * 512  # weights, grads, two moments
        assert len(optimizer.state) == 200
        assert not any(backend.counted(state["step"]) for state in optimizer.state.values())


# -- generate() computes, with figures --------------------------------------------------------

GENERATE = """
import torch
import transformers


def test_generate(vram):
    config = transformers.GPT2Config(vocab_size=256, n_positions=64, n_embd=32, n_layer=1,
                                     n_head=2)
    with torch.device("cuda"):
        model = transformers.GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 256, (1, 8), device="cuda")
    out = model.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 12)
"""


@pytest.mark.slow
def test_generate_computes_under_the_plugin(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_generate=GENERATE)
    result = pytester.runpytest_subprocess(
        "--vram-report", "--vram-backend=sim", "--vram-json", "figures.json"
    )
    result.assert_outcomes(passed=1)
    record = json.loads(Path(pytester.path, "figures.json").read_text())["tests"][0]
    assert record["backend"] == "sim"
    assert record["peak_allocated"] > 32 * 256 * 4  # the embeddings at least
    cache = pytester.path / ".pytest_cache" / "v" / "vram" / "needs_values"
    assert json.loads(cache.read_text()) == ["test_generate.py"]  # it needed values
