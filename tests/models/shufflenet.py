"""ShuffleNet-like: torchvision's ShuffleNetV2 (stride-1 units split the channels in halves with
``x.chunk(2, dim=1)``, run one half through a branch and concatenate; every unit ends in a
channel shuffle via view/transpose/contiguous/view; global pooling is ``x.mean([2, 3])``), at toy size."""

from __future__ import annotations

import torch
from torch import nn

from ._common import image_inputs, init_batch_norms

STAGES_REPEATS, STAGES_OUT_CHANNELS = (2, 2), (16, 32, 64, 128)


def channel_shuffle(x: torch.Tensor, groups: int) -> torch.Tensor:
    batchsize, num_channels, height, width = x.size()
    channels_per_group = num_channels // groups
    x = x.view(batchsize, groups, channels_per_group, height, width)
    x = torch.transpose(x, 1, 2).contiguous()
    return x.view(batchsize, num_channels, height, width)


def _depthwise(i: int, o: int, stride: int) -> nn.Conv2d:
    return nn.Conv2d(i, o, 3, stride, 1, bias=False, groups=i)


class InvertedResidual(nn.Module):
    def __init__(self, inp: int, oup: int, stride: int) -> None:
        super().__init__()
        self.stride = stride
        branch_features = oup // 2
        if self.stride > 1:
            self.branch1 = nn.Sequential(
                _depthwise(inp, inp, stride), nn.BatchNorm2d(inp),
                nn.Conv2d(inp, branch_features, 1, bias=False), nn.BatchNorm2d(branch_features), nn.ReLU(inplace=True),
            )
        else:
            self.branch1 = nn.Sequential()
        self.branch2 = nn.Sequential(
            nn.Conv2d(inp if self.stride > 1 else branch_features, branch_features, 1, bias=False),
            nn.BatchNorm2d(branch_features), nn.ReLU(inplace=True),
            _depthwise(branch_features, branch_features, stride), nn.BatchNorm2d(branch_features),
            nn.Conv2d(branch_features, branch_features, 1, bias=False), nn.BatchNorm2d(branch_features), nn.ReLU(inplace=True),
        )

    def forward(self, x):
        if self.stride == 1:
            x1, x2 = x.chunk(2, dim=1)
            out = torch.cat((x1, self.branch2(x2)), dim=1)
        else:
            out = torch.cat((self.branch1(x), self.branch2(x)), dim=1)
        return channel_shuffle(out, 2)


class ShuffleNetV2(nn.Module):
    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        input_channels = 3
        output_channels = STAGES_OUT_CHANNELS[0]
        self.conv1 = nn.Sequential(nn.Conv2d(input_channels, output_channels, 3, 2, 1, bias=False),
                                   nn.BatchNorm2d(output_channels), nn.ReLU(inplace=True))
        input_channels = output_channels
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        for name, repeats, output_channels in zip(("stage2", "stage3"), STAGES_REPEATS, STAGES_OUT_CHANNELS[1:]):
            seq = [InvertedResidual(input_channels, output_channels, 2)]
            seq += [InvertedResidual(output_channels, output_channels, 1) for _ in range(repeats - 1)]
            setattr(self, name, nn.Sequential(*seq))
            input_channels = output_channels
        output_channels = STAGES_OUT_CHANNELS[-1]
        self.conv5 = nn.Sequential(nn.Conv2d(input_channels, output_channels, 1, 1, 0, bias=False),
                                   nn.BatchNorm2d(output_channels), nn.ReLU(inplace=True))
        self.fc = nn.Linear(output_channels, num_classes)

    def forward(self, x):
        x = self.maxpool(self.conv1(x))
        x = self.conv5(self.stage3(self.stage2(x)))
        return self.fc(x.mean([2, 3]))


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return init_batch_norms(ShuffleNetV2()).eval()


example_inputs, calibration_batches = image_inputs((2, 3, 64, 64))
