"""Filters on small images, each value checked: a kornia-like file."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from pytest_vram import max_vram

SIZES = [(5, 5), (8, 8), (16, 12), (32, 32)]
BATCHES = [1, 2]
CHANNELS = [1, 3]


def gaussian_kernel1d(size: int, sigma: float, dtype: torch.dtype) -> torch.Tensor:
    x = torch.arange(size, dtype=dtype) - (size - 1) / 2
    kernel = torch.exp(-(x**2) / (2 * sigma**2))
    return kernel / kernel.sum()


def filter2d(image: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:
    channels = image.shape[1]
    weight = kernel.expand(channels, 1, *kernel.shape)
    pad_h, pad_w = kernel.shape[0] // 2, kernel.shape[1] // 2
    padded = F.pad(image, (pad_w, pad_w, pad_h, pad_h), mode="reflect")
    return F.conv2d(padded, weight, groups=channels)


def gaussian_blur(image: torch.Tensor, size: int, sigma: float) -> torch.Tensor:
    k = gaussian_kernel1d(size, sigma, image.dtype)
    return filter2d(image, torch.outer(k, k))


def box_blur(image: torch.Tensor, size: int) -> torch.Tensor:
    return filter2d(image, torch.full((size, size), 1.0 / size**2, dtype=image.dtype))


def sobel(image: torch.Tensor) -> torch.Tensor:
    kx = torch.tensor([[-1.0, 0.0, 1.0], [-2.0, 0.0, 2.0], [-1.0, 0.0, 1.0]], dtype=image.dtype)
    gx, gy = filter2d(image, kx), filter2d(image, kx.t())
    return torch.sqrt(gx * gx + gy * gy + 1e-6)


def laplacian(image: torch.Tensor) -> torch.Tensor:
    k = torch.tensor([[0.0, 1.0, 0.0], [1.0, -4.0, 1.0], [0.0, 1.0, 0.0]], dtype=image.dtype)
    return filter2d(image, k)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("kernel", [3, 5])
def test_gaussian_blur_keeps_a_constant(
    batch: int, channels: int, size: tuple[int, int], kernel: int
) -> None:
    image = torch.full((batch, channels, *size), 0.5)
    blurred = gaussian_blur(image, kernel, 1.5)
    assert blurred.shape == image.shape
    assert_close(blurred, image)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("channels", CHANNELS)
@pytest.mark.parametrize("kernel", [3, 5])
def test_box_blur_is_the_mean(
    batch: int, channels: int, size: tuple[int, int], kernel: int
) -> None:
    image = torch.rand(batch, channels, *size)
    blurred = box_blur(image, kernel)
    r = kernel // 2
    window = image[:, :, : 2 * r + 1, : 2 * r + 1]
    assert_close(blurred[:, :, r, r], window.mean((-2, -1)))


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("channels", CHANNELS)
def test_sobel_of_a_constant_is_flat(batch: int, channels: int, size: tuple[int, int]) -> None:
    edges = sobel(torch.ones(batch, channels, *size))
    assert_close(edges, torch.full_like(edges, 1e-3), atol=1e-4, rtol=0)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("channels", CHANNELS)
def test_laplacian_of_a_ramp(batch: int, channels: int, size: tuple[int, int]) -> None:
    ramp = torch.arange(size[1], dtype=torch.float32).expand(batch, channels, *size)
    out = laplacian(ramp.contiguous())
    assert_close(out[..., 1:-1, 1:-1], torch.zeros_like(out[..., 1:-1, 1:-1]))
