"""Flips, rotations and warps of small images, each value checked: a kornia-like file."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from pytest_vram import max_vram

SIZES = [(4, 4), (8, 6), (16, 16), (32, 24)]
BATCHES = [1, 2, 3]


def rotation_matrix(angle: torch.Tensor) -> torch.Tensor:
    cos, sin = torch.cos(angle), torch.sin(angle)
    zeros = torch.zeros_like(angle)
    return torch.stack([cos, -sin, zeros, sin, cos, zeros], -1).view(-1, 2, 3)


def warp_affine(image: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    grid = F.affine_grid(matrix, list(image.shape), align_corners=False)
    return F.grid_sample(image, grid, align_corners=False)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("dims", [(-1,), (-2,), (-2, -1)])
def test_flip_twice(batch: int, size: tuple[int, int], dims: tuple[int, ...]) -> None:
    image = torch.rand(batch, 3, *size)
    assert_close(image.flip(dims).flip(dims), image)
    assert_close(image.flip(dims)[..., 0, 0], image.flip(dims).flatten(-2)[..., 0])


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("turns", [1, 2, 3])
def test_rot90_four_times(batch: int, size: tuple[int, int], turns: int) -> None:
    image = torch.rand(batch, 3, *size)
    turned = torch.rot90(image, turns, (-2, -1))
    assert_close(torch.rot90(turned, 4 - turns, (-2, -1)), image)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
def test_identity_warp(batch: int, size: tuple[int, int]) -> None:
    image = torch.rand(batch, 3, *size)
    warped = warp_affine(image, rotation_matrix(torch.zeros(batch)))
    assert_close(warped, image, rtol=1e-4, atol=1e-4)


@max_vram("16MiB")
@pytest.mark.parametrize("size", [(8, 8), (16, 16)])
@pytest.mark.parametrize("batch", BATCHES)
def test_half_turn_warp_is_a_double_flip(batch: int, size: tuple[int, int]) -> None:
    image = torch.rand(batch, 3, *size)
    warped = warp_affine(image, rotation_matrix(torch.full((batch,), math.pi)))
    assert_close(warped, image.flip((-2, -1)), rtol=1e-4, atol=1e-4)


@max_vram("16MiB")
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("scale", [0.5, 2.0])
def test_resize_keeps_a_constant(batch: int, size: tuple[int, int], scale: float) -> None:
    image = torch.full((batch, 3, *size), 0.25)
    resized = F.interpolate(image, scale_factor=scale, mode="bilinear", align_corners=False)
    assert resized.shape[-2:] == (int(size[0] * scale), int(size[1] * scale))
    assert_close(resized, torch.full_like(resized, 0.25))
