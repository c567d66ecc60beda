"""U-Net-like: a segmentation network as torchvision-free code writes one (conv-BN-ReLU encoder stages with
max-pooling; a decoder that upsamples with ``nn.ConvTranspose2d(c, c', 2, stride=2)`` and concatenates the
encoder's skip; an FPN-style lateral that adds a nearest-upsampled coarser map; a head resized to the input
by bilinear interpolation), at toy size."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._common import image_inputs, init_batch_norms

WIDTHS = (16, 32, 64)


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, classes: int = 3) -> None:
        super().__init__()
        a, b, c = WIDTHS
        self.enc1, self.enc2, self.enc3 = _block(3, a), _block(a, b), _block(b, c)
        self.up2, self.dec2 = nn.ConvTranspose2d(c, b, 2, stride=2), _block(2 * b, b)
        self.up1, self.dec1 = nn.ConvTranspose2d(b, a, 2, stride=2), _block(2 * a, a)
        self.lateral = nn.Conv2d(c, a, 1)  # the coarsest map, brought up 4x to the finest decoder's
        self.head = nn.Conv2d(a, classes, 1)

    def forward(self, x):
        e1 = self.enc1(x)
        e2 = self.enc2(F.max_pool2d(e1, 2))
        e3 = self.enc3(F.max_pool2d(e2, 2))
        d2 = self.dec2(torch.cat([self.up2(e3), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1)) + F.interpolate(self.lateral(e3), scale_factor=4, mode="nearest")
        return F.interpolate(self.head(d1), scale_factor=2, mode="bilinear", align_corners=False)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return init_batch_norms(UNet()).eval()


example_inputs, calibration_batches = image_inputs((2, 3, 64, 64))
