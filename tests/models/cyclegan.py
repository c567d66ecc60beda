"""CycleGAN-like: the ResNet generator of image-to-image translation (CycleGAN, pix2pix, fast style transfer) as
its reference code writes it, at toy size: reflection padding, a 7x7 stem, stride-2 convolutions down, residual
blocks of ``ReflectionPad2d -> Conv2d -> InstanceNorm2d -> ReLU``, ``ConvTranspose2d(3, stride=2, padding=1,
output_padding=1)`` up, a 7x7 head and ``tanh``; instance norms over each image's own statistics."""

from __future__ import annotations

import torch
from torch import nn

from ._common import image_inputs

WIDTH, BLOCKS = 16, 2


def _norm_relu(channels: int) -> list:
    return [nn.InstanceNorm2d(channels), nn.ReLU(inplace=True)]


class ResidualBlock(nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.ReflectionPad2d(1), nn.Conv2d(channels, channels, 3), *_norm_relu(channels),
                                  nn.ReflectionPad2d(1), nn.Conv2d(channels, channels, 3), nn.InstanceNorm2d(channels))

    def forward(self, x):
        return x + self.body(x)


class ResnetGenerator(nn.Module):
    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS) -> None:
        super().__init__()
        layers = [nn.ReflectionPad2d(3), nn.Conv2d(3, width, 7), *_norm_relu(width)]
        for i in range(2):  # down: width -> 2 width -> 4 width, half the size each
            layers += [nn.Conv2d(width << i, width << (i + 1), 3, stride=2, padding=1), *_norm_relu(width << (i + 1))]
        layers += [ResidualBlock(width << 2) for _ in range(blocks)]
        for i in range(2, 0, -1):  # up: back to width, twice the size each
            layers += [nn.ConvTranspose2d(width << i, width << (i - 1), 3, stride=2, padding=1, output_padding=1),
                       *_norm_relu(width << (i - 1))]
        layers += [nn.ReflectionPad2d(3), nn.Conv2d(width, 3, 7), nn.Tanh()]
        self.model = nn.Sequential(*layers)

    def forward(self, x):
        return self.model(x)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return ResnetGenerator().eval()


example_inputs, calibration_batches = image_inputs((1, 3, 64, 64))
