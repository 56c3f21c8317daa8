"""Tests of the analytical estimator: parameter counts, model states, activations, KV cache,
the source articles' corrected figures and the ``pytest-vram estimate`` command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_vram.cli import main
from pytest_vram.estimate import (
    BREAKDOWN_KEYS,
    Estimate,
    EstimateError,
    Layer,
    count_parameters,
    estimate,
    format_si,
    parse_count,
    train_layer_activations,
)
from pytest_vram.units import format_size, parse_size

CONFIGS = Path(__file__).parent / "configs"
LLAMA2 = CONFIGS / "llama-2-7b.json"
LLAMA3 = CONFIGS / "meta-llama-3-8b.json"
MISTRAL = CONFIGS / "mistral-7b-v0.1.json"
QWEN32 = CONFIGS / "qwen2.5-32b.json"
QWEN05 = CONFIGS / "qwen2.5-0.5b.json"
DSV3 = CONFIGS / "deepseek-v3.json"
GIB = 1024**3


def small_llama(**overrides: object) -> dict[str, object]:
    """A llama-shaped config dict: easy to reason about in activation and KV tests."""
    cfg: dict[str, object] = {
        "model_type": "llama",
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "num_hidden_layers": 32,
        "vocab_size": 32000,
    }
    cfg.update(overrides)
    return cfg


# --- parameter counts ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("llama-2-7b.json", 6_738_415_616),
        ("meta-llama-3-8b.json", 8_030_261_248),
        ("mistral-7b-v0.1.json", 7_241_732_096),
        ("qwen2.5-32b.json", 32_763_876_352),
        ("qwen2.5-0.5b.json", 494_032_768),  # tied embeddings
        ("qwen3-8b.json", 8_190_735_360),
        ("mixtral-8x7b-v0.1.json", 46_702_792_704),
        ("deepseek-v2-lite.json", 15_706_484_224),
    ],
)
def test_parameter_counts_of_published_configs(name: str, expected: int) -> None:
    assert count_parameters(CONFIGS / name) == expected
    assert estimate(config=CONFIGS / name).parameters == expected


def test_deepseek_v3_counts_the_main_model_without_the_mtp_module() -> None:
    result = estimate(config=DSV3)
    # 671B published for the main model; the HF checkpoint's 685B adds the MTP module.
    assert result.parameters == pytest.approx(671e9, rel=0.002)
    assert result.active_parameters == pytest.approx(37e9, rel=0.02)
    assert any("multi-token-prediction" in note for note in result.notes)
    assert any("fp8 quantization" in note for note in result.notes)


def test_mixtral_active_parameters_are_two_of_eight_experts() -> None:
    result = estimate(config=CONFIGS / "mixtral-8x7b-v0.1.json")
    assert result.active_parameters == 12_879_925_248


def test_tied_embeddings_are_counted_once() -> None:
    untied = count_parameters(small_llama())
    tied = count_parameters(small_llama(tie_word_embeddings=True))
    assert untied - tied == 32000 * 2048


def test_qwen2_has_qkv_biases_and_llama_does_not() -> None:
    llama = count_parameters(small_llama(num_key_value_heads=4))
    qwen2 = count_parameters(small_llama(model_type="qwen2", num_key_value_heads=4))
    head_dim = 2048 // 16
    assert qwen2 - llama == 32 * (2048 + 2 * 4 * head_dim)


def test_config_accepts_a_model_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(LLAMA2.read_text())
    assert count_parameters(tmp_path) == 6_738_415_616


def test_unknown_model_type_names_the_missing_keys() -> None:
    gpt2 = {"model_type": "gpt2", "n_embd": 768, "n_layer": 12, "n_head": 12, "vocab_size": 50257}
    with pytest.raises(EstimateError) as info:
        count_parameters(gpt2)
    message = str(info.value)
    assert "unknown model_type 'gpt2'" in message
    assert "llama" in message and "deepseek_v3" in message
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers"):
        assert key in message
    assert "vocab_size" not in message.split("lacks")[1]


def test_known_model_type_with_missing_keys() -> None:
    cfg = small_llama()
    del cfg["hidden_size"], cfg["num_hidden_layers"]
    with pytest.raises(EstimateError, match="needs keys this config lacks: hidden_size, num_hid"):
        count_parameters(cfg)
    with pytest.raises(EstimateError, match="missing keys: model_type"):
        count_parameters({"hidden_size": 4096})
    with pytest.raises(EstimateError, match="'hidden_size' must be a positive integer"):
        count_parameters(small_llama(hidden_size="4096"))


# --- weights per dtype ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dtype", "per_param"), [("fp32", 4), ("fp16", 2), ("bf16", 2), ("fp8", 1), ("int8", 1)]
)
def test_weight_bytes_per_dtype(dtype: str, per_param: int) -> None:
    result = estimate(params="7B", dtype=dtype)
    assert result.breakdown["weights"] == per_param * 7_000_000_000
    assert result.per_gpu_bytes == per_param * 7_000_000_000


def test_int4_weights_carry_group_scales_and_zero_points() -> None:
    n = 7_000_000_000
    groups = n // 128  # one fp16 scale and one 4-bit zero point per 128 weights
    expected = n // 2 + groups * 2 + groups // 2
    assert estimate(params=n, dtype="int4").breakdown["weights"] == expected
    assert expected / n == pytest.approx(0.5 + 2.5 / 128)


def test_quantized_config_keeps_embeddings_and_norms_in_bf16() -> None:
    hidden, ffn, vocab, layers = 4096, 11008, 32000, 32
    linear = layers * (4 * hidden * hidden + 3 * hidden * ffn)
    other = 6_738_415_616 - linear
    int8 = estimate(config=LLAMA2, dtype="int8").breakdown["weights"]
    assert int8 == linear + 2 * other
    int4 = estimate(config=LLAMA2, dtype="int4").breakdown["weights"]
    groups = linear // 128
    assert int4 == linear // 2 + groups * 2 + groups // 2 + 2 * other
    assert other == 2 * vocab * hidden + (2 * layers + 1) * hidden


# --- model states: optimizers and ZeRO -----------------------------------------------------------


def test_mixed_precision_adamw_is_16_bytes_per_parameter() -> None:
    n = 1_000_000_000
    result = estimate(params=n, mode="train", dtype="bf16", optimizer="adamw")
    assert result.breakdown["weights"] == 2 * n
    assert result.breakdown["gradients"] == 2 * n
    assert result.breakdown["optimizer"] == 12 * n  # fp32 master weights, m and v
    assert result.per_gpu_bytes == 16 * n


@pytest.mark.parametrize(
    ("dtype", "optimizer", "state"),
    [
        ("fp32", "adamw", 8),
        ("fp32", "sgd", 4),
        ("bf16", "sgd", 8),  # master weights + momentum
        ("fp16", "adamw", 12),
    ],
)
def test_optimizer_state_sizes(dtype: str, optimizer: str, state: int) -> None:
    n = 3_000_000_000
    result = estimate(params=n, mode="train", dtype=dtype, optimizer=optimizer)
    assert result.breakdown["optimizer"] == state * n
    weight = 4 if dtype == "fp32" else 2
    assert result.breakdown["weights"] == result.breakdown["gradients"] == weight * n


def test_adam8bit_is_two_bytes_plus_block_absmax() -> None:
    n = 2_560_000_000
    result = estimate(params=n, mode="train", optimizer="adam8bit")
    assert result.breakdown["optimizer"] == 4 * n + 2 * n + 2 * 4 * (n // 256)


def test_adafactor_factors_the_second_moment() -> None:
    result = estimate(config=LLAMA2, mode="train", optimizer="adafactor", dtype="fp32")
    # A matrix keeps one fp32 row and one fp32 column: under 0.1% of Adam's 8 bytes per weight.
    assert 0 < result.breakdown["optimizer"] < 0.001 * 8 * 6_738_415_616
    hidden, ffn = 4096, 11008
    per_layer = 4 * (4 * 2 * hidden + 2 * (ffn + hidden) + (hidden + ffn)) + 4 * 2 * hidden
    embeddings = 2 * 4 * (32000 + hidden)
    assert result.breakdown["optimizer"] == 32 * per_layer + embeddings + 4 * hidden
    bare = estimate(params="7B", mode="train", optimizer="adafactor")
    assert bare.breakdown["optimizer"] == 4 * 7_000_000_000
    assert any("Adafactor" in note for note in bare.notes)


@pytest.mark.parametrize(
    ("zero", "gigabytes"), [(0, 120.0), (1, 31.40625), (2, 16.640625), (3, 1.875)]
)
def test_zero_paper_table(zero: int, gigabytes: float) -> None:
    # ZeRO paper, figure 1: 7.5B parameters, 64 GPUs, K = 12 -> 120 / 31.4 / 16.6 / 1.9 GB.
    result = estimate(params=7.5e9, mode="train", dtype="fp16", gpus=64, zero=zero)
    states = sum(result.breakdown[k] for k in ("weights", "gradients", "optimizer"))
    assert states == int(gigabytes * 1e9)
    assert result.per_gpu_bytes == states
    assert round(states / 1e9, 1) == {0: 120.0, 1: 31.4, 2: 16.6, 3: 1.9}[zero]


def test_zero3_with_a_config_counts_the_gathered_layer() -> None:
    result = estimate(config=QWEN32, mode="train", gpus=8, zero=3)
    layer = (32_763_876_352 - 2 * 152064 * 5120 - 5120) // 64
    assert result.breakdown["zero3_gathered"] == 4 * layer  # bf16 weights and gradients
    assert result.breakdown["weights"] == -(-2 * 32_763_876_352 // 8)


def test_offload_moves_sharded_states_to_host() -> None:
    n = 8_000_000_000
    result = estimate(params=n, mode="train", gpus=8, zero=3, offload="all")
    assert result.breakdown["weights"] == result.breakdown["optimizer"] == 0
    assert result.host_bytes == 16 * n // 8
    assert result.host_breakdown == {"weights": 2 * n // 8, "gradients": 2 * n // 8,
                                     "optimizer": 12 * n // 8}  # fmt: skip
    assert result.to_dict()["host_bytes_total"] == 16 * n

    stage1 = estimate(params=n, mode="train", gpus=8, zero=1, offload="optimizer")
    assert stage1.host_breakdown["optimizer"] == 12 * n // 8
    assert stage1.breakdown["gradients"] == 2 * n
    stage2 = estimate(params=n, mode="train", gpus=8, zero=2, offload="optimizer")
    assert stage2.host_bytes == 14 * n // 8
    assert stage2.per_gpu_bytes == 2 * n


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"offload": "optimizer"}, "needs ZeRO stage 1, 2 or 3"),
        ({"offload": "all", "zero": 2}, "needs zero 3"),
        ({"dtype": "int4"}, "not modelled"),
        ({"gpus": 6, "tp": 4}, "multiple of tp x pp"),
    ],
)
def test_inconsistent_training_options(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(EstimateError, match=message):
        estimate(params="7B", mode="train", **kwargs)  # type: ignore[arg-type]


# --- tensor and pipeline parallelism -------------------------------------------------------------


def test_tensor_parallel_splits_linears_and_vocabulary_not_norms() -> None:
    one = estimate(config=LLAMA2).breakdown["weights"]
    two = estimate(config=LLAMA2, gpus=2, tp=2).breakdown["weights"]
    norms = 2 * (2 * 32 + 1) * 4096  # replicated on every rank
    assert two == (one - norms) // 2 + norms


def test_tensor_parallel_replicates_kv_heads_beyond_their_count() -> None:
    tp8 = estimate(config=LLAMA3, gpus=8, tp=8, seq=4096).breakdown["kv_cache"]
    tp16 = estimate(config=LLAMA3, gpus=16, tp=16, seq=4096).breakdown["kv_cache"]
    assert tp8 == 2 * 32 * 1 * 128 * 4096 * 2
    assert tp16 == tp8  # 8 KV heads cannot be cut 16 ways: one per rank
    with pytest.raises(EstimateError, match="must divide the number of attention heads"):
        estimate(config=LLAMA3, gpus=3, tp=3)


def test_pipeline_parallel_reports_the_largest_stage() -> None:
    layer = 202_383_360
    inference = estimate(config=LLAMA2, gpus=2, pp=2)
    assert inference.pipeline_stage == 1  # the last stage holds the final norm and logits
    assert inference.breakdown["weights"] == 2 * (16 * layer + 32000 * 4096 + 4096)
    train = estimate(config=LLAMA2, gpus=2, pp=2, mode="train")
    assert train.pipeline_stage == 0  # 1F1B: stage 0 keeps pp micro-batches of activations
    whole = estimate(config=LLAMA2, mode="train")
    head = 2 * 2 * 2048 * 4096  # final norm and output-layer inputs, on the last stage only
    assert train.breakdown["activations"] == whole.breakdown["activations"] - head


def test_pipeline_parallel_with_tied_embeddings_copies_them_to_the_last_stage() -> None:
    result = estimate(config=QWEN05, gpus=2, pp=2)
    stage_layers = 12 * 14_912_384
    assert result.breakdown["weights"] == 2 * (stage_layers + 151936 * 896 + 896)


# --- activations ---------------------------------------------------------------------------------


def gpt_layer(h: int, a: int) -> Layer:
    """The layer Korthikanti et al. analyse: MHA, 4h GeLU MLP, dropout everywhere."""
    return Layer(
        tensors=(),
        heads=a,
        kv_heads=a,
        qk_head_dim=h // a,
        v_head_dim=h // a,
        ffn=4 * h,
        gated=False,
        attention_dropout=True,
        hidden_dropout=True,
    )


def test_korthikanti_per_layer_formula() -> None:
    s, b, h, a = 2048, 4, 6144, 48  # GPT-3 22B-like
    lin, quad = train_layer_activations(gpt_layer(h, a), h, b, s, 2, 1, "eager")
    assert lin + quad == s * b * h * (34 + 5 * a * s / h)
    assert quad == 5 * a * s * s * b


def test_korthikanti_with_tensor_and_sequence_parallel() -> None:
    s, b, h, a, t = 2048, 1, 12288, 96, 8
    lin, quad = train_layer_activations(gpt_layer(h, a), h, b, s, 2, t, "eager")
    assert lin + quad == s * b * h // t * (34 + 5 * a * s // h)


def test_flash_attention_drops_the_quadratic_term() -> None:
    s, b, h, a = 4096, 1, 4096, 32
    lin, quad = train_layer_activations(gpt_layer(h, a), h, b, s, 2, 1, "flash")
    assert quad == 0
    assert lin == 34 * s * b * h + 4 * a * s * b  # plus flash's fp32 log-sum-exp per row


def llama3_layer_bytes(s: int, b: int, eager: bool) -> tuple[int, int]:
    h, a, g, d, f, e = 4096, 32, 8, 128, 14336, 2
    tok = s * b
    lin = e * tok * (2 * h + h + (a * d + g * d) + g * d + a * d + h) + 4 * e * tok * f
    quad = e * a * s * s * b if eager else 0
    if not eager:
        lin += 4 * a * s * b
    return lin, quad


def test_gqa_and_gated_mlp_adaptation() -> None:
    s, b = 2048, 1
    lin, _ = llama3_layer_bytes(s, b, eager=False)
    head = 2 * 2 * s * b * 4096
    result = estimate(config=LLAMA3, mode="train", seq=s, batch=b)
    assert result.breakdown["activations"] == 32 * lin + head
    # The loss: bf16 logits, their fp32 copy and the fp32 log-softmax.
    assert result.breakdown["logits"] == (2 + 4 + 4) * s * b * 128256


def test_eager_attention_and_recomputation() -> None:
    s, b, layers = 4096, 2, 32
    head = 2 * 2 * s * b * 4096
    lin, quad = llama3_layer_bytes(s, b, eager=True)
    flash_lin, _ = llama3_layer_bytes(s, b, eager=False)
    train = {"config": LLAMA3, "mode": "train", "seq": s, "batch": b}

    def acts(**kwargs: object) -> int:
        return estimate(**train, **kwargs).breakdown["activations"]  # type: ignore[arg-type]

    assert acts(attention="eager") == layers * (lin + quad) + head
    # Selective: keep no s^2 term; rematerialise one layer's attention core in backward.
    assert acts(attention="eager", recompute="selective") == layers * lin + quad + head
    assert acts(recompute="selective") == acts()  # flash already recomputes its core
    # Full: keep each layer's input, rematerialise one layer in backward.
    layer_input = 2 * s * b * 4096
    assert acts(recompute="full") == layers * layer_input + flash_lin + head
    assert acts(recompute="full") < acts(recompute="selective") < acts(attention="eager")


def test_tensor_parallel_divides_activations() -> None:
    one = estimate(config=LLAMA3, mode="train")
    two = estimate(config=LLAMA3, mode="train", gpus=2, tp=2)
    assert two.breakdown["activations"] == one.breakdown["activations"] // 2
    assert two.breakdown["logits"] == one.breakdown["logits"] // 2


def test_inference_activations_are_one_layer_working_set() -> None:
    s, b, h, f, e = 2048, 1, 4096, 14336, 2
    result = estimate(config=LLAMA3, seq=s, batch=b)
    assert result.breakdown["activations"] == e * s * b * (2 * h + 3 * f)
    assert result.breakdown["logits"] == e * s * b * 128256
    assert result.breakdown["gradients"] == result.breakdown["optimizer"] == 0


def test_params_only_reports_no_activations_and_says_why() -> None:
    result = estimate(params="7B", mode="train", batch=8, seq=4096)
    assert result.breakdown["activations"] == result.breakdown["kv_cache"] == 0
    assert any("need the model's shape" in note for note in result.notes)


# --- KV cache ------------------------------------------------------------------------------------


def test_kv_cache_mha() -> None:
    result = estimate(config=LLAMA2, batch=1, seq=4096, dtype="fp16")
    assert result.breakdown["kv_cache"] == 2 * 32 * 32 * 128 * 4096 * 1 * 2 == 2 * GIB


def test_kv_cache_gqa_uses_the_kv_head_count() -> None:
    result = estimate(config=LLAMA3, batch=16, seq=8192)
    assert result.breakdown["kv_cache"] == 2 * 32 * 8 * 128 * 8192 * 16 * 2 == 16 * GIB


def test_kv_cache_is_capped_at_the_sliding_window() -> None:
    capped = estimate(config=MISTRAL, seq=16384).breakdown["kv_cache"]
    assert capped == 2 * 32 * 8 * 128 * 4096 * 2
    assert estimate(config=MISTRAL, seq=2048).breakdown["kv_cache"] == capped // 2
    # Qwen2.5 declares a window but does not use it (use_sliding_window: false).
    qwen = estimate(config=QWEN32, seq=32768).breakdown["kv_cache"]
    assert qwen == 2 * 64 * 8 * 128 * 32768 * 2 == 8 * GIB


def test_kv_cache_mla_holds_the_compressed_latent() -> None:
    result = estimate(config=DSV3, seq=4096, batch=2)
    assert result.breakdown["kv_cache"] == 61 * (512 + 64) * 4096 * 2 * 2


def test_kv_cache_dtype_and_training() -> None:
    fp32 = estimate(config=LLAMA3, dtype="fp32").breakdown["kv_cache"]
    int4 = estimate(config=LLAMA3, dtype="int4").breakdown["kv_cache"]
    assert fp32 == 2 * int4  # quantised weights still cache K and V in 16-bit
    assert estimate(config=LLAMA3, mode="train").breakdown["kv_cache"] == 0


def test_default_seq_is_capped_by_max_position_embeddings() -> None:
    assert estimate(config=LLAMA2).inputs["seq"] == 2048
    short = small_llama(max_position_embeddings=1024)
    assert estimate(config=short).inputs["seq"] == 1024
    note = estimate(config=short, seq=4096).notes
    assert any("max_position_embeddings" in n for n in note)


# --- the source articles' figures, corrected (shared/seeds/README.md) ----------------------------


def test_seed_fp16_weights_of_a_32b_model() -> None:
    assert estimate(params="32B", dtype="fp16").breakdown["weights"] == 64 * 10**9
    assert format_size(64 * 10**9) == "59.60 GiB"
    qwen = estimate(config=QWEN32, dtype="bf16").breakdown["weights"]
    assert qwen == 2 * 32_763_876_352
    assert format_si(qwen) == "65.53 GB"


def test_seed_adam_moments_of_a_32b_model() -> None:
    result = estimate(params="32B", mode="train", dtype="fp32", optimizer="adamw")
    assert result.breakdown["optimizer"] == 256 * 10**9


def test_seed_kv_cache_per_layer_and_for_32_layers() -> None:
    one_layer = small_llama(num_hidden_layers=1)
    per_layer = estimate(config=one_layer, batch=16, seq=2048, dtype="fp16")
    assert per_layer.breakdown["kv_cache"] == GIB // 4
    all_layers = estimate(config=small_llama(), batch=16, seq=2048, dtype="fp16")
    assert all_layers.breakdown["kv_cache"] == 8 * GIB


def test_seed_training_is_16_bytes_per_parameter_not_twice_the_weights() -> None:
    result = estimate(params="32B", mode="train", dtype="fp16")
    assert result.per_gpu_bytes == 16 * 32 * 10**9
    assert result.per_gpu_bytes == 8 * estimate(params="32B", dtype="fp16").per_gpu_bytes


# --- the Python API ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count"),
    [("7e9", 7 * 10**9), ("7B", 7 * 10**9), ("7b", 7 * 10**9), ("1.5B", 1_500_000_000),
     ("350M", 350_000_000), ("7_000_000_000", 7 * 10**9), (7.5e9, 7_500_000_000),
     (123, 123)],
)  # fmt: skip
def test_parse_count(text: object, count: int) -> None:
    assert parse_count(text) == count


@pytest.mark.parametrize("bad", ["-7B", "0", "abc", "7GB", "1.5", "", None, True, float("nan")])
def test_parse_count_rejects(bad: object) -> None:
    with pytest.raises(EstimateError, match="params must be"):
        parse_count(bad)


def test_estimate_result_is_a_budget() -> None:
    result = estimate(config=QWEN05, batch=4, seq=1024)
    assert isinstance(result, Estimate)
    assert set(result.breakdown) == set(BREAKDOWN_KEYS)
    assert all(isinstance(v, int) for v in result.breakdown.values())
    assert result.per_gpu_bytes == sum(result.breakdown.values())
    # max_vram takes sizes through parse_size: an int of bytes is a valid budget.
    assert parse_size(result.per_gpu_bytes) == result.per_gpu_bytes
    assert "per GPU" in str(result)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"params": "7B", "dtype": "fp9"}, "dtype must be one of"),
        ({"params": "7B", "mode": "serve"}, "mode must be one of"),
        ({"params": "7B", "batch": 0}, "batch must be a positive integer"),
        ({"params": "7B", "zero": "3"}, "zero must be one of"),
        ({"params": "7B", "zero": True}, "zero must be one of"),
        ({"params": "7B", "offload": "optimizer", "zero": 1}, "applies to training"),
        ({}, "exactly one of"),
        ({"params": "7B", "config": LLAMA2}, "exactly one of"),
        ({"config": 42}, "config must be a path or a dict"),
    ],
)
def test_estimate_rejects_bad_input(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(EstimateError, match=message):
        estimate(**kwargs)  # type: ignore[arg-type]


# --- the command line ----------------------------------------------------------------------------


def test_cli_prints_a_readable_breakdown(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--config", str(QWEN32), "--mode", "train", "--gpus", "8", "--zero", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "32,763,876,352 parameters" in out
    assert "8 GPUs = dp 8 x tp 1 x pp 1, ZeRO-3" in out
    weights = -(-2 * 32_763_876_352 // 8)
    assert f"{format_size(weights)}" in out and f"{format_si(weights)}" in out
    assert f"{weights:,}" in out
    for key in BREAKDOWN_KEYS:
        assert f"  {key} " in out


def test_cli_json(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["estimate", "--params", "7.5e9", "--mode", "train", "--dtype", "fp16"]
    assert main([*argv, "--gpus", "64", "--zero", "1", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"] == 7_500_000_000
    assert data["per_gpu_bytes"] == 31_406_250_000
    assert set(BREAKDOWN_KEYS) <= set(data["breakdown"])
    assert data["inputs"]["zero"] == 1 and data["inputs"]["gpus"] == 64
    assert data["host_bytes"] == 0


def test_cli_help_lists_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["estimate", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for text in ("--dtype bf16", "--seq 2048", "--attention flash", "default: inference"):
        assert text in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", "no/such/config.json"], "not found"),
        (["--config", "{bad}"], "is not valid JSON"),
        (["--params=-7B"], "must be positive"),
        (["--params", "seven"], "--params must be"),
        (["--params", "7B", "--dtype", "fp9"], "--dtype must be one of"),
        (["--params", "7B", "--zero", "4"], "--zero must be one of"),
        (["--params", "7B", "--batch", "0"], "--batch must be a positive integer"),
        (["--params", "7B", "--gpus", "many"], "--gpus must be a positive integer"),
        ([], "exactly one of --config"),
        (["--params", "7B", "--config", str(LLAMA2)], "exactly one of --config"),
        (["--config", "{gpt2}"], "unknown model_type 'gpt2'"),
        (["--params", "7B", "--mode", "train", "--dtype", "int4"], "not modelled"),
    ],
)
def test_cli_bad_input_is_a_clear_error(
    args: list[str], message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    files = {"{bad}": '{"model_type": "llama",', "{gpt2}": '{"model_type": "gpt2"}'}
    for i, arg in enumerate(args):
        if arg in files:
            path = tmp_path / "config.json"
            path.write_text(files[arg])
            args[i] = str(path)
    assert main(["estimate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pytest-vram: error: ")
    assert message in err
    assert "Traceback" not in err


def test_cli_subprocess_json() -> None:
    argv = ["estimate", "--config", str(LLAMA3), "--batch", "16", "--seq", "8192", "--json"]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_vram.cli", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["parameters"] == 8_030_261_248
    assert data["breakdown"]["kv_cache"] == 16 * GIB
    assert data["per_gpu_bytes"] == sum(data["breakdown"].values())
    assert data["inputs"]["model_type"] == "llama"


def test_cli_subprocess_error_has_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "config.json"
    bad.write_text("not json")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest_vram.cli", "estimate", "--config", str(bad)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2
    assert "is not valid JSON" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            '{"hidden_size": ' + "9" * 5000 + "}",
            "holds a number with more digits than Python reads",
        ),
        ("[" * 100_000 + "]" * 100_000, "is nested too deeply to read"),
    ],
    ids=["5000 digits", "100000 deep"],
)
def test_a_config_python_cannot_read_is_one_line_naming_it(
    text: str, message: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.json"
    path.write_text(text)
    assert main(["estimate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pytest-vram: error: config file {str(path)!r} {message}")
    assert len(err.splitlines()) == 1


def _llama_with(tmp_path: Path, **sizes: int) -> Path:
    config = json.loads(LLAMA2.read_text())
    config.update(sizes)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("hidden_size", [10**12, 10**200])
def test_a_model_beyond_any_real_one_is_refused(
    hidden_size: int, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _llama_with(tmp_path, hidden_size=hidden_size)
    assert main(["estimate", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"pytest-vram: error: {path}: ")
    assert "beyond any real model" in err or "larger than a 64-bit size" in err
    assert len(err.splitlines()) == 1


def test_the_table_stays_in_columns_for_the_largest_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["estimate", "--params", "5e17", "--mode", "train", "--dtype", "fp32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.startswith("per GPU"))
    total = next(line for line in out.splitlines() if line.startswith("  total"))
    assert total.endswith("8,000,000,000,000,000,000") and len(total) == len(header)
    # Each figure is a cell of its own: three after the label, apart.
    assert len(total.split()) == 1 + 2 + 2 + 1
