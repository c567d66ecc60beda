"""quantize_weight: a float weight's per-channel symmetric int8 codes and scales on a kernel's
weight grid. Numerics shared by convert (lowering, reference mode) and quantize_dynamic."""

from __future__ import annotations

import copy
from typing import Optional, Tuple

import torch
from torch import nn

from lucid_fx.quantization.dtypes import QDtype
from lucid_fx.quantization.fake_quantize import FakeQuantize
from lucid_fx.quantization.functional import quantize
from lucid_fx.quantization.qparams import calculate_qparams

__all__ = ["quantize_weight"]


def _trained_scale(observer: Optional[nn.Module], weight: torch.Tensor, weight_range: Tuple[int, int]):
    """The per-channel scale a QAT weight FakeQuantize trained with, if it is on the kernel's grid."""
    if not isinstance(observer, FakeQuantize) or not observer.has_data or not observer.qscheme.is_symmetric:
        return None
    if (observer.quant_min, observer.quant_max) != tuple(weight_range) or observer.scale.numel() not in (1, weight.shape[0]):
        return None
    return observer.scale.detach().float().expand(weight.shape[0]).to(weight.device)


def quantize_weight(weight: torch.Tensor, observer: Optional[nn.Module], weight_range: Tuple[int, int]):
    """Per-channel symmetric int8 codes and scales of ``weight`` on the kernel's grid.

    The weight is observed afresh (batch-norm folding may have changed it since prepare) by a copy
    of the observer the QConfig chose; a per-tensor observer's range is used for every channel.
    A QAT weight keeps the qparams it was trained with, so the int8 weight is the one training saw."""
    weight = weight.detach()
    qmin, qmax = weight_range
    grid = QDtype(f"qint[{qmin},{qmax}]", 8, True, qmin, qmax, torch.int8)
    trained = _trained_scale(observer, weight, weight_range)
    if trained is not None:
        return quantize(weight, trained, torch.zeros_like(trained, dtype=torch.int64), grid, ch_axis=0), trained
    if observer is not None and hasattr(observer, "reset_min_max_vals"):
        observer = copy.deepcopy(observer)
        observer.reset_min_max_vals()
        observer(weight)
        lo, hi = observer.min_val, observer.max_val
        if lo.dim() == 0:
            lo, hi = lo.expand(weight.shape[0]), hi.expand(weight.shape[0])
    else:
        flat = weight.reshape(weight.shape[0], -1)
        lo, hi = flat.amin(1), flat.amax(1)
    # (a copy of an observer made on the CPU holds its state there, whatever the weight's device)
    scale, zero_point = calculate_qparams(lo.to(weight.device), hi.to(weight.device), "per_channel_symmetric", grid)
    return quantize(weight, scale, zero_point, grid, ch_axis=0), scale.float()
