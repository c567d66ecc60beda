"""ConvNeXt-like: torchvision's ConvNeXt (CNBlock: depthwise 7x7 conv, LayerNorm over channels
through permutes, Linear-GELU-Linear, layer scale, eval-mode stochastic depth, in-place residual;
LayerNorm2d stem and downsampling), at toy size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import StochasticDepth, image_inputs

DIMS, DEPTHS, STOCHASTIC_DEPTH = (16, 32, 64), (1, 2, 1), 0.1


class LayerNorm2d(nn.LayerNorm):
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Permute(nn.Module):
    def __init__(self, dims) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x):
        return torch.permute(x, self.dims)


class CNBlock(nn.Module):
    def __init__(self, dim: int, layer_scale: float, stochastic_depth_prob: float) -> None:
        super().__init__()
        self.block = nn.Sequential(
            nn.Conv2d(dim, dim, kernel_size=7, padding=3, groups=dim, bias=True),
            Permute([0, 2, 3, 1]),
            nn.LayerNorm(dim, eps=1e-6),
            nn.Linear(dim, 4 * dim),
            nn.GELU(),
            nn.Linear(4 * dim, dim),
            Permute([0, 3, 1, 2]),
        )
        self.layer_scale = nn.Parameter(torch.ones(dim, 1, 1) * layer_scale)
        self.stochastic_depth = StochasticDepth(stochastic_depth_prob, "row")

    def forward(self, input):
        result = self.layer_scale * self.block(input)
        result = self.stochastic_depth(result)
        result += input
        return result


class ConvNeXt(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        layers = [nn.Sequential(nn.Conv2d(3, DIMS[0], kernel_size=4, stride=4), LayerNorm2d(DIMS[0], eps=1e-6))]
        total, done = sum(DEPTHS), 0
        for i, (dim, depth) in enumerate(zip(DIMS, DEPTHS)):
            # layer scale 0.5, not torchvision's 1e-6: random weights must leave the blocks visible
            layers.append(nn.Sequential(*[CNBlock(dim, 0.5, STOCHASTIC_DEPTH * (done + j) / (total - 1)) for j in range(depth)]))
            done += depth
            if i + 1 < len(DIMS):
                layers.append(nn.Sequential(LayerNorm2d(dim, eps=1e-6), nn.Conv2d(dim, DIMS[i + 1], kernel_size=2, stride=2)))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(LayerNorm2d(DIMS[-1], eps=1e-6), nn.Flatten(1), nn.Linear(DIMS[-1], num_classes))

    def forward(self, x):
        return self.classifier(self.avgpool(self.features(x)))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return ConvNeXt().eval()


example_inputs, calibration_batches = image_inputs((2, 3, 64, 64))
