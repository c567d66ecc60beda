"""fold_bn_into: the arithmetic of folding an eval-mode batch norm into the conv or linear before it.

Shared by eager fusion (:func:`lucid_fx.quantization.fuse_modules`) and convert's graph pass
(``lucid_fx.passes.fold_batchnorm``), which decide *where* to fold; this module only computes the
folded weights: ``w' = w * gamma / sqrt(var + eps)`` per output channel and
``b' = (b - mean) * gamma / sqrt(var + eps) + beta``.

>>> import torch
>>> from torch import nn
>>> conv, bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4).eval()
>>> x = torch.randn(1, 3, 5, 5)
>>> torch.allclose(fold_bn_into(conv, bn)(x), bn(conv(x)), atol=1e-6)
True
"""

from __future__ import annotations

import copy

import torch
from torch import nn

__all__ = ["fold_bn_into"]


def fold_bn_into(layer: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A copy of ``layer`` whose output equals ``bn(layer(x))`` for an eval-mode ``bn``."""
    fused = copy.deepcopy(layer)
    with torch.no_grad():
        inv_std = torch.rsqrt(bn.running_var + bn.eps)
        gamma = bn.weight if bn.affine else torch.ones_like(inv_std)
        beta = bn.bias if bn.affine else torch.zeros_like(inv_std)
        factor = gamma * inv_std
        shape = [-1] + [1] * (fused.weight.dim() - 1)
        fused.weight.copy_(fused.weight * factor.reshape(shape))
        bias = fused.bias if fused.bias is not None else torch.zeros_like(bn.running_mean)
        new_bias = (bias - bn.running_mean) * factor + beta
        fused.bias = nn.Parameter(new_bias)
    return fused
