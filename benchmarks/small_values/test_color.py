"""Colour conversions on small images, each value checked: a kornia-like file."""

from __future__ import annotations

import math

import pytest
import torch
from torch.testing import assert_close

from pytest_vram import max_vram

SIZES = [(4, 5), (8, 8), (16, 12), (32, 32)]
BATCHES = [1, 2, 4]
DTYPES = [torch.float32, torch.float64]


def rgb_to_grayscale(image: torch.Tensor) -> torch.Tensor:
    r, g, b = image.unbind(-3)
    return (0.299 * r + 0.587 * g + 0.114 * b).unsqueeze(-3)


def rgb_to_hsv(image: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    maxc, argmax = image.max(-3)
    minc = image.min(-3).values
    v = maxc
    delta = maxc - minc
    s = delta / (v + eps)
    delta = torch.where(delta == 0, torch.ones_like(delta), delta)
    r, g, b = image.unbind(-3)
    rc, gc, bc = maxc - r, maxc - g, maxc - b
    h = torch.stack([bc - gc, 2.0 * delta + rc - bc, 4.0 * delta + gc - rc], dim=-3)
    h = torch.gather(h, -3, argmax.unsqueeze(-3)).squeeze(-3) / delta
    h = (h / 6.0) % 1.0 * 2 * math.pi
    return torch.stack([h, s, v], dim=-3)


def hsv_to_rgb(image: torch.Tensor) -> torch.Tensor:
    h = image[..., 0, :, :] / (2 * math.pi)
    s, v = image[..., 1, :, :], image[..., 2, :, :]
    hi = torch.floor(h * 6) % 6
    f = (h * 6) % 6 - hi
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    hi = hi.long()
    indices = torch.stack([hi, hi + 6, hi + 12], dim=-3)
    out = torch.stack((v, q, p, p, t, v, t, v, v, q, p, p, p, p, t, v, v, q), dim=-3)
    return torch.gather(out, -3, indices)


def rgb_to_ycbcr(image: torch.Tensor) -> torch.Tensor:
    r, g, b = image.unbind(-3)
    y = 0.299 * r + 0.587 * g + 0.114 * b
    cb = (b - y) * 0.564 + 0.5
    cr = (r - y) * 0.713 + 0.5
    return torch.stack([y, cb, cr], -3)


def ycbcr_to_rgb(image: torch.Tensor) -> torch.Tensor:
    y, cb, cr = image.unbind(-3)
    cb, cr = cb - 0.5, cr - 0.5
    r = y + 1.403 * cr
    g = y - 0.714 * cr - 0.344 * cb
    b = y + 1.773 * cb
    return torch.stack([r, g, b], -3)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_grayscale(batch: int, size: tuple[int, int], dtype: torch.dtype) -> None:
    image = torch.rand(batch, 3, *size, dtype=dtype)
    gray = rgb_to_grayscale(image)
    assert gray.shape == (batch, 1, *size)
    expected = 0.299 * image[:, 0] + 0.587 * image[:, 1] + 0.114 * image[:, 2]
    assert_close(gray[:, 0], expected)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_hsv_round_trip(batch: int, size: tuple[int, int], dtype: torch.dtype) -> None:
    image = torch.rand(batch, 3, *size, dtype=dtype)
    assert_close(hsv_to_rgb(rgb_to_hsv(image)), image, rtol=1e-4, atol=1e-4)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_ycbcr_round_trip(batch: int, size: tuple[int, int], dtype: torch.dtype) -> None:
    image = torch.rand(batch, 3, *size, dtype=dtype)
    assert_close(ycbcr_to_rgb(rgb_to_ycbcr(image)), image, rtol=1e-3, atol=1e-3)


@max_vram("16MiB")
@pytest.mark.parametrize("value", [0.0, 0.25, 0.5, 1.0])
def test_grey_has_no_saturation(value: float) -> None:
    image = torch.full((1, 3, 4, 4), value)
    hsv = rgb_to_hsv(image)
    assert_close(hsv[:, 1], torch.zeros(1, 4, 4))
    assert_close(hsv[:, 2], torch.full((1, 4, 4), value))
