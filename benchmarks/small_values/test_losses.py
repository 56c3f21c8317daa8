"""Image losses and metrics on small images, each value checked: a kornia-like file."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from pytest_vram import max_vram

SIZES = [(8, 8), (16, 16), (32, 24)]
BATCHES = [1, 2, 4]


def psnr(image: torch.Tensor, target: torch.Tensor, max_value: float = 1.0) -> torch.Tensor:
    mse = F.mse_loss(image, target)
    return 10.0 * torch.log10(max_value**2 / mse)


def total_variation(image: torch.Tensor) -> torch.Tensor:
    dh = (image[..., 1:, :] - image[..., :-1, :]).abs().sum((-3, -2, -1))
    dw = (image[..., :, 1:] - image[..., :, :-1]).abs().sum((-3, -2, -1))
    return dh + dw


def ssim(image: torch.Tensor, target: torch.Tensor, window: int = 3) -> torch.Tensor:
    c1, c2 = 0.01**2, 0.03**2
    pool = torch.nn.AvgPool2d(window, 1, window // 2, count_include_pad=False)
    mu_x, mu_y = pool(image), pool(target)
    sigma_x = pool(image * image) - mu_x**2
    sigma_y = pool(target * target) - mu_y**2
    sigma_xy = pool(image * target) - mu_x * mu_y
    num = (2 * mu_x * mu_y + c1) * (2 * sigma_xy + c2)
    den = (mu_x**2 + mu_y**2 + c1) * (sigma_x + sigma_y + c2)
    return (num / den).mean()


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("noise", [0.1, 0.01])
def test_psnr_of_known_noise(batch: int, size: tuple[int, int], noise: float) -> None:
    image = torch.rand(batch, 3, *size)
    noisy = image + noise
    assert_close(psnr(noisy, image), torch.tensor(-20.0 * math.log10(noise)))


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
def test_ssim_of_an_image_with_itself(batch: int, size: tuple[int, int]) -> None:
    image = torch.rand(batch, 3, *size)
    assert_close(ssim(image, image), torch.tensor(1.0))


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
def test_total_variation_of_a_constant(batch: int, size: tuple[int, int]) -> None:
    assert_close(total_variation(torch.full((batch, 3, *size), 0.3)), torch.zeros(batch))


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_l1_and_mse_gradients(batch: int, size: tuple[int, int], reduction: str) -> None:
    image = torch.rand(batch, 3, *size, requires_grad=True)
    target = torch.rand(batch, 3, *size)
    loss = F.l1_loss(image, target, reduction=reduction) + F.mse_loss(
        image, target, reduction=reduction
    )
    loss.backward()
    scale = 1.0 if reduction == "sum" else 1.0 / image.numel()
    expected = (torch.sign(image - target) + 2 * (image - target)) * scale
    assert image.grad is not None
    assert_close(image.grad, expected.detach())
