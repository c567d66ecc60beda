"""MobileNetV2-like: torchvision's MobileNetV2 (inverted residuals: 1x1 expand -> 3x3 depthwise ->
1x1 project, each conv with a batch norm, ReLU6 after the first two, a residual add where the
shapes allow; ``F.adaptive_avg_pool2d``, ``torch.flatten``, dropout and a linear head), at width
0.5 on 64x64 images.

Hard to quantize the way a trained MobileNetV2 is (Nagel et al. 2019, fig. 2): the folded
depthwise weights of one layer span three decades. As in the trained net, that is a depthwise
batch norm amplifying near-dead input channels: each channel a depthwise conv reads is made
``10**uniform(0, 3)`` times smaller by the batch norm before it, and the batch-norm statistics
are measured on data (not made up, so activations stay in range through the depth). The small
channels fall below one step of their tensor's int8 grid, and the depthwise conv multiplies
that rounding by up to 1000.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ._common import image_inputs, init_batch_norms

WIDTH, CLASSES, IMAGE = 0.5, 10, 64
# expansion t, output channels c, repeats n, first stride s (torchvision's inverted_residual_setting)
CONFIG = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]


def _make_divisible(v: float, divisor: int = 8, min_value: Optional[int] = None) -> int:
    min_value = min_value or divisor
    new_v = max(min_value, int(v + divisor / 2) // divisor * divisor)
    return new_v + divisor if new_v < 0.9 * v else new_v


class Conv2dNormActivation(nn.Sequential):
    def __init__(self, cin: int, cout: int, kernel_size: int = 3, stride: int = 1, groups: int = 1) -> None:
        super().__init__(
            nn.Conv2d(cin, cout, kernel_size, stride, (kernel_size - 1) // 2, groups=groups, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU6(inplace=True),
        )


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int, expand_ratio: int) -> None:
        super().__init__()
        hidden_dim = int(round(inp * expand_ratio))
        self.use_res_connect = stride == 1 and inp == oup
        layers: List[nn.Module] = []
        if expand_ratio != 1:
            layers.append(Conv2dNormActivation(inp, hidden_dim, kernel_size=1))
        layers += [
            Conv2dNormActivation(hidden_dim, hidden_dim, stride=stride, groups=hidden_dim),
            nn.Conv2d(hidden_dim, oup, 1, 1, 0, bias=False),
            nn.BatchNorm2d(oup),
        ]
        self.conv = nn.Sequential(*layers)

    def forward(self, x):
        if self.use_res_connect:
            return x + self.conv(x)
        return self.conv(x)


class MobileNetV2(nn.Module):
    def __init__(self, num_classes: int = CLASSES, width_mult: float = WIDTH) -> None:
        super().__init__()
        input_channel = _make_divisible(32 * width_mult)
        self.last_channel = _make_divisible(1280 * max(1.0, width_mult))
        features: List[nn.Module] = [Conv2dNormActivation(3, input_channel, stride=2)]
        for t, c, n, s in CONFIG:
            output_channel = _make_divisible(c * width_mult)
            for i in range(n):
                features.append(InvertedResidual(input_channel, output_channel, s if i == 0 else 1, t))
                input_channel = output_channel
        features.append(Conv2dNormActivation(input_channel, self.last_channel, kernel_size=1))
        self.features = nn.Sequential(*features)
        self.classifier = nn.Sequential(nn.Dropout(p=0.2), nn.Linear(self.last_channel, num_classes))
        for m in self.modules():  # torchvision's initialisation
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out")
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        x = self.features(x)
        x = F.adaptive_avg_pool2d(x, (1, 1))
        return self.classifier(torch.flatten(x, 1))


RESIDUAL_GAIN = 0.25


def _trained_looking(model: MobileNetV2, generator: torch.Generator) -> MobileNetV2:
    """Batch-norm affine parameters of a trained net, statistics measured on data; each channel
    that a depthwise conv reads made 10**uniform(0, 3) times smaller by the batch norm before it."""
    units = [m for m in model.modules() if isinstance(m, Conv2dNormActivation)]
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.copy_(torch.rand(m.num_features, generator=generator) * 0.5 + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=generator) * 0.2 + 0.2)
                m.momentum = None  # a cumulative average over the batches below
        for m in model.modules():
            if isinstance(m, InvertedResidual) and m.use_res_connect:
                m.conv[-1].weight.mul_(RESIDUAL_GAIN)
                m.conv[-1].bias.mul_(RESIDUAL_GAIN)
        for before, unit in zip(units, units[1:]):
            if unit[0].groups > 1:  # a depthwise unit: shrink the channels it reads
                bn = before[1]
                shrink = 10 ** -(torch.rand(bn.num_features, generator=generator) * 3)
                bn.weight.mul_(shrink)
                bn.bias.mul_(shrink)
        model.train()
        for i in range(4):
            model(torch.randn(8, 3, IMAGE, IMAGE, generator=generator))
    return model.eval()


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return _trained_looking(MobileNetV2(), torch.Generator().manual_seed(0)).eval()


example_inputs, calibration_batches = image_inputs((2, 3, IMAGE, IMAGE))
