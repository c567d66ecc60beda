"""The demo's data: 10 classes of procedural 1x32x32 grey images (gratings at four orientations, a
checkerboard, rings, a blob, scattered dots, a cross, a square outline) with a random frequency,
phase, position and contrast, plus Gaussian pixel noise, generated from a seed. Used by
:mod:`lucid_fx.demo`, which re-exports :data:`CLASSES` and :func:`make_patterns`."""

from __future__ import annotations

import math
from typing import Tuple

import torch

__all__ = ["CLASSES", "SIZE", "make_patterns"]

CLASSES = (
    "horizontal", "vertical", "diagonal", "antidiagonal", "checkerboard",
    "rings", "blob", "dots", "cross", "square",
)
SIZE = 32


def _uniform(g: torch.Generator, n: int, lo: float, hi: float) -> torch.Tensor:
    return torch.rand(n, 1, 1, generator=g) * (hi - lo) + lo


def _gaussian(u: torch.Tensor, v: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    return torch.exp(-(u * u + v * v) / (2 * sigma * sigma))


def _pattern(label: int, n: int, x: torch.Tensor, y: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """``n`` noise-free images of class ``label``, values roughly in [-1, 1]."""
    freq = _uniform(g, n, 2.0, 4.5) * (2 * math.pi)  # cycles per image width, as radians per unit
    phase = _uniform(g, n, 0.0, 2 * math.pi)
    u, v = x - _uniform(g, n, -0.4, 0.4), y - _uniform(g, n, -0.4, 0.4)
    if label == 0:
        return torch.sin(freq * y / 2 + phase)
    if label == 1:
        return torch.sin(freq * x / 2 + phase)
    if label == 2:
        return torch.sin(freq * (x + y) / (2 * math.sqrt(2)) + phase)
    if label == 3:
        return torch.sin(freq * (x - y) / (2 * math.sqrt(2)) + phase)
    if label == 4:
        return torch.sign(torch.sin(freq * x / 2 + phase) * torch.sin(freq * y / 2 + phase.flip(0)))
    if label == 5:
        return torch.sin(freq * torch.sqrt(u * u + v * v) + phase)
    if label == 6:
        return 2 * _gaussian(u, v, _uniform(g, n, 0.2, 0.4)) - 1
    if label == 7:
        dots = sum(_gaussian(x - _uniform(g, n, -0.8, 0.8), y - _uniform(g, n, -0.8, 0.8), _uniform(g, n, 0.05, 0.09)) for _ in range(5))
        return 2 * dots.clamp(max=1) - 1
    if label == 8:
        width = _uniform(g, n, 0.06, 0.12)
        return 2 * torch.maximum(_gaussian(u, 0 * v, width), _gaussian(0 * u, v, width)) - 1
    half, width = _uniform(g, n, 0.25, 0.5), _uniform(g, n, 0.05, 0.1)
    return 2 * torch.exp(-((torch.maximum(u.abs(), v.abs()) - half) ** 2) / (2 * width * width)) - 1


def make_patterns(n: int, seed: int, noise: float = 0.5) -> Tuple[torch.Tensor, torch.Tensor]:
    """``n`` images (``n x 1 x 32 x 32``, float32) and their labels (0..9), balanced and shuffled.

    >>> images, labels = make_patterns(20, seed=0)
    >>> tuple(images.shape), labels.bincount().tolist()
    ((20, 1, 32, 32), [2, 2, 2, 2, 2, 2, 2, 2, 2, 2])
    """
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(n) % len(CLASSES))[torch.randperm(n, generator=g)]
    axis = torch.linspace(-1, 1, SIZE)
    y, x = torch.meshgrid(axis, axis, indexing="ij")
    images = torch.empty(n, SIZE, SIZE)
    for label in range(len(CLASSES)):
        index = (labels == label).nonzero().flatten()
        if len(index):
            contrast = _uniform(g, len(index), 0.5, 1.0)
            images[index] = contrast * _pattern(label, len(index), x, y, g)
    images += noise * torch.randn(images.shape, generator=g)
    return images.unsqueeze(1), labels
