"""The benchmark models, in plain torch; also used by the end-to-end tests.

Each factory returns ``(model, example_input, make_batch)`` with the model in eval mode and
``make_batch(seed)`` giving calibration/evaluation batches from a fixed distribution.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["MODELS", "mlp", "resnet_like", "encoder_block", "gated_mlp", "mobilenet_v3_like", "efficientnet_like"]


class MLP(nn.Module):
    def __init__(self, width: int = 1024, layers: int = 3) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])

    def forward(self, x):
        return self.layers(x)


class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = F.relu(self.bn1(self.conv1(x)))
        return F.relu(self.bn2(self.conv2(out)) + identity)


class ResNetLike(nn.Module):
    """ResNet-18's layout ([2, 2, 2, 2] basic blocks, 64..512 channels)."""

    def __init__(self, num_classes: int = 1000, width: int = 64) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        blocks, cin = [], width
        for i, mult in enumerate((1, 2, 4, 8)):
            cout = width * mult
            blocks += [BasicBlock(cin, cout, 1 if i == 0 else 2), BasicBlock(cout, cout, 1)]
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        x = self.maxpool(F.relu(self.bn1(self.conv1(x))))
        x = self.blocks(x)
        return self.fc(torch.flatten(self.pool(x), 1))


class EncoderBlock(nn.Module):
    """One transformer encoder block: softmax attention, LayerNorm, GELU MLP."""

    def __init__(self, d: int = 256, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.scale = (d // heads) ** -0.5
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.norm1, self.norm2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        h = self.heads
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, h, d // h).permute(2, 0, 3, 1, 4)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self.scale
        attn = torch.matmul(F.softmax(scores, dim=-1), v)
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class GatedMLP(nn.Module):
    """A gated sigmoid/tanh MLP (GLU-style gates)."""

    def __init__(self, width: int = 1024) -> None:
        super().__init__()
        self.value, self.gate = nn.Linear(width, width), nn.Linear(width, width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        return self.out(torch.tanh(self.value(x)) * torch.sigmoid(self.gate(x)))


def _divisible(value: float, divisor: int = 8) -> int:
    rounded = max(divisor, int(value + divisor / 2) // divisor * divisor)
    return rounded + divisor if rounded < 0.9 * value else rounded


class SqueezeExcite(nn.Module):
    """x * gate(mean(x)): the channel gate of MobileNetV3 (relu, hardsigmoid) and EfficientNet (silu, sigmoid)."""

    def __init__(self, channels: int, squeezed: int, act: type, gate: type) -> None:
        super().__init__()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.reduce, self.expand = nn.Conv2d(channels, squeezed, 1), nn.Conv2d(squeezed, channels, 1)
        self.act, self.gate = act(), gate()

    def forward(self, x):
        return x * self.gate(self.expand(self.act(self.reduce(self.pool(x)))))


def _conv_bn(cin: int, cout: int, kernel: int, stride: int = 1, groups: int = 1, act: type = None) -> nn.Sequential:
    layers = [nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
    return nn.Sequential(*layers, act()) if act is not None else nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    """Expand 1x1 -> depthwise kxk -> squeeze-excite -> project 1x1, with a residual add when shapes allow."""

    def __init__(self, cin, expanded, cout, kernel, stride, act, se_squeezed=None, se_act=None, se_gate=None):
        super().__init__()
        layers = [] if expanded == cin else [_conv_bn(cin, expanded, 1, act=act)]
        layers.append(_conv_bn(expanded, expanded, kernel, stride, groups=expanded, act=act))
        if se_squeezed:
            layers.append(SqueezeExcite(expanded, se_squeezed, se_act, se_gate))
        layers.append(_conv_bn(expanded, cout, 1))
        self.block = nn.Sequential(*layers)
        self.residual = stride == 1 and cin == cout

    def forward(self, x):
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetV3Like(nn.Module):
    """MobileNetV3-Small's layout: depthwise convolutions, hardswish, squeeze-excite with hardsigmoid."""

    # kernel, expanded, out, squeeze-excite, activation (relu or hardswish), stride
    CONFIG = [
        (3, 16, 16, True, "RE", 2), (3, 72, 24, False, "RE", 2), (3, 88, 24, False, "RE", 1),
        (5, 96, 40, True, "HS", 2), (5, 240, 40, True, "HS", 1), (5, 240, 40, True, "HS", 1),
        (5, 120, 48, True, "HS", 1), (5, 144, 48, True, "HS", 1), (5, 288, 96, True, "HS", 2),
        (5, 576, 96, True, "HS", 1), (5, 576, 96, True, "HS", 1),
    ]

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers, cin = [_conv_bn(3, 16, 3, 2, act=nn.Hardswish)], 16
        for kernel, expanded, cout, se, act, stride in self.CONFIG:
            act = nn.ReLU if act == "RE" else nn.Hardswish
            squeezed = _divisible(expanded // 4) if se else None
            layers.append(InvertedResidual(cin, expanded, cout, kernel, stride, act, squeezed, nn.ReLU, nn.Hardsigmoid))
            cin = cout
        layers.append(_conv_bn(cin, 576, 1, act=nn.Hardswish))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Sequential(nn.Linear(576, 1024), nn.Hardswish(), nn.Linear(1024, num_classes))

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


class EfficientNetLike(nn.Module):
    """EfficientNet-B0's layout: MBConv blocks with SiLU and squeeze-excite with sigmoid."""

    # expansion, out channels, repeats, stride, kernel
    CONFIG = [(1, 16, 1, 1, 3), (6, 24, 2, 2, 3), (6, 40, 2, 2, 5), (6, 80, 3, 2, 3), (6, 112, 3, 1, 5),
              (6, 192, 4, 2, 5), (6, 320, 1, 1, 3)]

    def __init__(self, num_classes: int = 1000) -> None:
        super().__init__()
        layers, cin = [_conv_bn(3, 32, 3, 2, act=nn.SiLU)], 32
        for expansion, cout, repeats, stride, kernel in self.CONFIG:
            for i in range(repeats):
                squeezed = max(1, cin // 4)
                layers.append(InvertedResidual(cin, cin * expansion, cout, kernel, stride if i == 0 else 1, nn.SiLU,
                                               squeezed, nn.SiLU, nn.Sigmoid))
                cin = cout
        layers.append(_conv_bn(cin, 1280, 1, act=nn.SiLU))
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.classifier = nn.Linear(1280, num_classes)

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def _init_bn(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give batch norms trained-looking statistics so folding is exercised for real."""
    g = torch.Generator().manual_seed(seed)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            with torch.no_grad():
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)
                m.weight.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model


def mlp(batch: int = 64, width: int = 1024):
    torch.manual_seed(0)
    return MLP(width).eval(), torch.randn(batch, width), lambda s: torch.randn(batch, width, generator=torch.Generator().manual_seed(s))


def resnet_like(batch: int = 1, size: int = 224, width: int = 64):
    torch.manual_seed(0)
    shape = (batch, 3, size, size)
    return _init_bn(ResNetLike(width=width)).eval(), torch.randn(shape), lambda s: torch.randn(shape, generator=torch.Generator().manual_seed(s))


def encoder_block(batch: int = 8, seq: int = 128, d: int = 256):
    torch.manual_seed(0)
    shape = (batch, seq, d)
    return EncoderBlock(d).eval(), torch.randn(shape), lambda s: torch.randn(shape, generator=torch.Generator().manual_seed(s))


def gated_mlp(batch: int = 64, width: int = 1024):
    torch.manual_seed(0)
    return GatedMLP(width).eval(), torch.randn(batch, width), lambda s: torch.randn(batch, width, generator=torch.Generator().manual_seed(s))


def _image_model(cls, batch: int, size: int):
    torch.manual_seed(0)
    shape = (batch, 3, size, size)
    return _init_bn(cls()).eval(), torch.randn(shape), lambda s: torch.randn(shape, generator=torch.Generator().manual_seed(s))


def mobilenet_v3_like(batch: int = 1, size: int = 224):
    return _image_model(MobileNetV3Like, batch, size)


def efficientnet_like(batch: int = 1, size: int = 224):
    return _image_model(EfficientNetLike, batch, size)


MODELS = {
    "mlp_b64": lambda: mlp(64),
    "mlp_b1": lambda: mlp(1),
    "resnet_1x": lambda: resnet_like(1),
    "resnet_8x": lambda: resnet_like(8),
    "encoder": lambda: encoder_block(),
    "gated_mlp": lambda: gated_mlp(),
    "mobilenet_v3": lambda: mobilenet_v3_like(1),
    "efficientnet": lambda: efficientnet_like(1),
}
