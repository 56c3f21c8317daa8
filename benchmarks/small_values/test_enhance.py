"""Brightness, contrast, normalisation and histograms of small images, each value checked: a
kornia-like file."""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from pytest_vram import max_vram

SIZES = [(4, 4), (8, 8), (16, 12), (32, 32)]
BATCHES = [1, 2, 4]


def adjust_brightness(image: torch.Tensor, factor: float) -> torch.Tensor:
    return (image + factor).clamp(0.0, 1.0)


def adjust_contrast(image: torch.Tensor, factor: float) -> torch.Tensor:
    return (image * factor).clamp(0.0, 1.0)


def normalize(image: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return (image - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)


def denormalize(image: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    return image * std.view(1, -1, 1, 1) + mean.view(1, -1, 1, 1)


def equalize_hist(image: torch.Tensor, bins: int = 16) -> torch.Tensor:
    flat = (image.flatten(-2) * (bins - 1)).round().long()
    hist = torch.zeros(*flat.shape[:-1], bins).scatter_add_(
        -1, flat, torch.ones_like(flat, dtype=image.dtype)
    )
    cdf = hist.cumsum(-1) / flat.shape[-1]
    return cdf.gather(-1, flat).view_as(image)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("factor", [0.0, 0.25, 1.0])
def test_brightness(batch: int, size: tuple[int, int], factor: float) -> None:
    image = torch.rand(batch, 3, *size)
    out = adjust_brightness(image, factor)
    assert_close(out, torch.clamp(image + factor, max=1.0))
    assert out.max() <= 1.0


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("factor", [0.5, 1.0, 2.0])
def test_contrast(batch: int, size: tuple[int, int], factor: float) -> None:
    image = torch.rand(batch, 3, *size)
    assert_close(adjust_contrast(image, factor), (image * factor).clamp(0, 1))


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
def test_normalize_round_trip(batch: int, size: tuple[int, int]) -> None:
    image = torch.rand(batch, 3, *size)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    normalized = normalize(image, mean, std)
    assert_close(denormalize(normalized, mean, std), image)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
def test_equalized_histogram_is_monotone(batch: int, size: tuple[int, int]) -> None:
    image = torch.rand(batch, 3, *size)
    out = equalize_hist(image)
    assert out.shape == image.shape
    assert bool(((out >= 0) & (out <= 1)).all())
    order = image.flatten(-2).argsort(-1)
    ranked = out.flatten(-2).gather(-1, order)
    assert bool((ranked.diff(dim=-1) >= 0).all())
