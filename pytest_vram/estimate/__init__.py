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

from pytest_vram.estimate.cli import add_cli_parser
from pytest_vram.estimate.config import SUPPORTED_MODEL_TYPES, load_config
from pytest_vram.estimate.core import estimate
from pytest_vram.estimate.model import Layer, Model, Tensor, count_parameters, model_from_config
from pytest_vram.estimate.options import (
    ATTENTIONS,
    DTYPES,
    MODES,
    OFFLOADS,
    OPTIMIZERS,
    RECOMPUTES,
    EstimateError,
    parse_count,
)
from pytest_vram.estimate.result import BREAKDOWN_KEYS, Estimate, format_si
from pytest_vram.estimate.terms import inference_layer_activations, train_layer_activations

__all__ = [
    "ATTENTIONS",
    "BREAKDOWN_KEYS",
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
