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

__all__ = ["quantize_weight", "quantize_layer_weight", "CLIP_SEARCH", "CLIP_REFINE"]

#: On a grid narrower than 8 bits ([-64, 63]: CPUs without VNNI), each channel's scale is the fraction of its
#: min/max scale, in [0.8, 1], that rounds its weights with the least squared error (clipping the largest few
#: where that pays): the best of these, then of steps of 0.005 around it. Measured (forced AVX2 kind, oneDNN at
#: AVX2, the eleven family models of tests/models, output SQNR, min/max -> least error): ShuffleNet-like 41.5 ->
#: 42.4 dB (torch.ao 41.7), EfficientNet-like 40.5 -> 45.1, U-Net-like 46.7 -> 50.0, DenseNet-like 42.5 -> 44.3,
#: ConvNeXt-like 28.7 -> 29.1, the others within 0.2 (ViT-like 31.6 -> 31.5). The figures move by 1-3 dB with
#: the candidates (steps of 0.01 alone: 43.4, 42.1, 50.3, 42.4, 28.8; ViT-like 31.0): rounding luck, but above
#: min/max on the convolutional families each time. On the full 8-bit grid the same search lost 0.1-1.5 dB on
#: five of nine families (its rounding error is 4x smaller, so clipping costs more than it saves): off there.
CLIP_SEARCH = tuple(1.0 - 0.02 * i for i in range(11))
CLIP_REFINE = (-0.015, -0.01, -0.005, 0.005, 0.01, 0.015)


def _trained_scale(observer: Optional[nn.Module], weight: torch.Tensor, weight_range: Tuple[int, int]):
    """The per-channel scale a QAT weight FakeQuantize trained with, if it is on the kernel's grid."""
    if not isinstance(observer, FakeQuantize) or not observer.has_data or not observer.qscheme.is_symmetric:
        return None
    if (observer.quant_min, observer.quant_max) != tuple(weight_range) or observer.scale.numel() not in (1, weight.shape[0]):
        return None
    return observer.scale.detach().float().expand(weight.shape[0]).to(weight.device)


def quantize_weight(weight: torch.Tensor, observer: Optional[nn.Module], weight_range: Tuple[int, int],
                    least_error: bool = False):
    """Per-channel symmetric int8 codes and scales of ``weight`` on the kernel's grid.

    The weight is observed afresh (batch-norm folding may have changed it since prepare) by a copy
    of the observer the QConfig chose; a per-tensor observer's range is used for every channel.
    A QAT weight keeps the qparams it was trained with, so the int8 weight is the one training saw.
    ``least_error`` (a convolution's or linear's weight: :func:`quantize_layer_weight`): on a grid
    narrower than 8 bits, each channel of a per-channel observer takes the scale of :data:`CLIP_SEARCH`'s
    with the least rounding error."""
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
        if lo.dim() == 0:  # a per-tensor observer: its one range for every channel, as the QConfig asks
            least_error, lo, hi = False, lo.expand(weight.shape[0]), hi.expand(weight.shape[0])
    else:
        flat = weight.reshape(weight.shape[0], -1)
        lo, hi = flat.amin(1), flat.amax(1)
    # (a copy of an observer made on the CPU holds its state there, whatever the weight's device)
    scale, zero_point = calculate_qparams(lo.to(weight.device), hi.to(weight.device), "per_channel_symmetric", grid)
    if least_error and qmax - qmin < 255:
        scale = _least_error_scale(weight, scale, qmin, qmax)
    return quantize(weight, scale, zero_point, grid, ch_axis=0), scale.float()


def quantize_layer_weight(weight: torch.Tensor, observer: Optional[nn.Module], target, groups: int = 1):
    """:func:`quantize_weight` of a convolution's or linear's weight in ``groups`` groups, as convert, the
    reference model and ``correct_bias`` quantize it: on the grid ``target`` (a
    :class:`~lucid_fx.kernels.target.Target`) gives that layer, with the least-error scales."""
    return quantize_weight(weight, observer, target.layer_weight_range(weight.shape, groups), least_error=True)


def _least_error_scale(weight: torch.Tensor, scale: torch.Tensor, qmin: int, qmax: int) -> torch.Tensor:
    """Per channel, the scale (a fraction of ``scale``: :data:`CLIP_SEARCH`, then :data:`CLIP_REFINE` around
    the best) whose rounding of ``weight`` has the least squared error."""
    rows = weight.reshape(weight.shape[0], -1).float()
    base = scale.to(rows.dtype)

    def error(fraction: torch.Tensor) -> torch.Tensor:
        step = (base * fraction).clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(1)
        return (torch.clamp(torch.round(rows / step), qmin, qmax) * step - rows).pow(2).sum(1)

    best = torch.ones_like(base)
    best_error = error(best)
    for fractions in (CLIP_SEARCH[1:], CLIP_REFINE):
        centre = best
        for f in fractions:
            candidate = (centre + f).clamp(CLIP_SEARCH[-1], 1.0) if fractions is CLIP_REFINE else torch.full_like(base, f)
            e = error(candidate)
            better = e < best_error
            best_error, best = torch.where(better, e, best_error), torch.where(better, candidate, best)
    return (base * best).to(scale.dtype)
