"""EfficientNet-like: torchvision's MBConv (SiLU, squeeze-excite with a sigmoid gate, eval-mode
stochastic depth before an in-place residual ``result += input``), at toy size.

The conv-bn(-act) and squeeze-excite blocks are the benchmark models' (benchmarks/models.py);
the benchmark's EfficientNet-B0 itself has no stochastic depth and is too large for a quick run.
"""

from __future__ import annotations

import torch
from torch import nn

from ._common import StochasticDepth, benchmark_models, image_inputs, init_batch_norms

_conv_bn, SqueezeExcite = benchmark_models._conv_bn, benchmark_models.SqueezeExcite
# expansion, out channels, repeats, stride, kernel (B0's first four stages, narrower)
CONFIG = [(1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 32, 2, 2, 5), (6, 48, 2, 2, 3)]
STOCHASTIC_DEPTH = 0.2


class MBConv(nn.Module):
    def __init__(self, cin: int, expansion: int, cout: int, kernel: int, stride: int, sd_prob: float) -> None:
        super().__init__()
        self.use_res_connect = stride == 1 and cin == cout
        expanded = cin * expansion
        layers = [] if expanded == cin else [_conv_bn(cin, expanded, 1, act=nn.SiLU)]
        layers += [
            _conv_bn(expanded, expanded, kernel, stride, groups=expanded, act=nn.SiLU),
            SqueezeExcite(expanded, max(1, cin // 4), nn.SiLU, nn.Sigmoid),
            _conv_bn(expanded, cout, 1),
        ]
        self.block = nn.Sequential(*layers)
        self.stochastic_depth = StochasticDepth(sd_prob, "row")

    def forward(self, input):
        result = self.block(input)
        if self.use_res_connect:
            result = self.stochastic_depth(result)
            result += input
        return result


class EfficientNet(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        layers, cin = [_conv_bn(3, 16, 3, 2, act=nn.SiLU)], 16
        total, done = sum(r for _, _, r, _, _ in CONFIG), 0
        for expansion, cout, repeats, stride, kernel in CONFIG:
            for i in range(repeats):
                layers.append(MBConv(cin, expansion, cout, kernel, stride if i == 0 else 1, STOCHASTIC_DEPTH * done / total))
                cin, done = cout, done + 1
        layers.append(_conv_bn(cin, 4 * cin, 1, act=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Dropout(0.2, inplace=True), nn.Linear(4 * cin, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return init_batch_norms(EfficientNet()).eval()


example_inputs, calibration_batches = image_inputs((2, 3, 64, 64))
