"""Reading a Hugging Face config.json: the file, the model families and their required keys."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from pytest_vram.estimate.options import EstimateError

#: The largest value of a size key: a tensor's dimensions are 64-bit integers in PyTorch.
MAX_SIZE = (1 << 63) - 1

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
_REQUIRED_KEYS = {
    "mixtral": _MIXTRAL_KEYS,
    "deepseek_v2": _DEEPSEEK_KEYS,
    "deepseek_v3": _DEEPSEEK_KEYS,
}


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
    except RecursionError:
        raise EstimateError(
            f"config file {str(p)!r} is nested too deeply to read (deeper than Python's JSON "
            "reader goes)"
        ) from None
    except ValueError:  # int()'s refusal of a number thousands of digits long
        raise EstimateError(
            f"config file {str(p)!r} holds a number with more digits than Python reads; "
            f"a size of a model has at most {len(str(MAX_SIZE))}"
        ) from None
    if not isinstance(data, dict):
        raise EstimateError(
            f"config file {str(p)!r} must hold a JSON object, not {type(data).__name__}"
        )
    return data


def check_family(cfg: Mapping[str, Any], source: str) -> str:
    """The config's ``model_type``, once it is a supported family with every key it needs."""
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
    missing = _missing(cfg, _REQUIRED_KEYS.get(model_type, _DENSE_KEYS))
    if missing:
        raise EstimateError(
            f"{source}: model_type {model_type!r} needs keys this config lacks: "
            f"{', '.join(missing)}"
        )
    return str(model_type)


def pos_int(cfg: Mapping[str, Any], key: str, source: str, default: int | None = None) -> int:
    """A positive integer key; ``default`` when it is absent or null."""
    value = cfg.get(key)
    if value is None:
        if default is None:  # pragma: no cover - callers check required keys first
            raise EstimateError(f"{source}: key {key!r} is missing")
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise EstimateError(f"{source}: key {key!r} must be a positive integer, got {value!r}")
    if value > MAX_SIZE:
        raise EstimateError(
            f"{source}: key {key!r} is larger than a 64-bit size (at most {MAX_SIZE:,}): "
            "no real model has it"
        )
    return value


def opt_int(cfg: Mapping[str, Any], key: str, source: str) -> int:
    """An integer key that may be absent, null or 0 (for example ``q_lora_rank``)."""
    value = cfg.get(key)
    if value is None or value == 0:
        return 0
    return pos_int(cfg, key, source)


def _missing(cfg: Mapping[str, Any], keys: Iterable[str]) -> list[str]:
    return [k for k in keys if cfg.get(k) is None]
