"""Closed-form qparams: from an observed range, and from a proven output interval."""

from __future__ import annotations

import math
import struct
from typing import Tuple, Union

import torch

from lucid_fx.quantization.dtypes import QDtype, QScheme, to_qdtype, to_qscheme

__all__ = ["calculate_qparams", "fixed_qparams_for_interval", "per_batch_qparams"]

Number = Union[float, int, torch.Tensor]


def calculate_qparams(
    min_val: Number,
    max_val: Number,
    qscheme: Union[QScheme, str] = QScheme.PER_TENSOR_AFFINE,
    qdtype: Union[QDtype, str] = "quint8",
    eps: float = 1e-8,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Scale and zero point that map ``[min_val, max_val]`` (widened to include 0) onto the grid.

    Per-tensor inputs give shape ``()`` results, per-channel ``(C,)`` inputs give ``(C,)``.

    >>> s, z = calculate_qparams(-2.0, 6.0, "per_tensor_affine", "quint8")
    >>> round(s.item(), 4), int(z)
    (0.0314, 64)
    """
    qscheme, qdtype = to_qscheme(qscheme), to_qdtype(qdtype)
    min_val = torch.as_tensor(min_val, dtype=torch.float32)
    max_val = torch.as_tensor(max_val, dtype=torch.float32)
    if min_val.shape != max_val.shape:
        raise ValueError(f"min_val shape {tuple(min_val.shape)} != max_val shape {tuple(max_val.shape)}")
    if bool((min_val > max_val).any()):
        raise ValueError(f"min_val must not exceed max_val, got min={min_val.tolist()} max={max_val.tolist()}")
    qmin, qmax = qdtype.quant_min, qdtype.quant_max
    min_neg = torch.clamp(min_val, max=0.0)
    max_pos = torch.clamp(max_val, min=0.0)
    eps_t = torch.tensor(eps, dtype=torch.float32, device=min_val.device)
    if qscheme.is_symmetric:
        max_abs = torch.maximum(-min_neg, max_pos)
        scale = torch.maximum(max_abs / ((qmax - qmin) / 2), eps_t)
        mid = 0 if qdtype.signed else (qmin + qmax + 1) // 2
        zero_point = torch.full_like(scale, mid, dtype=torch.int64)
    else:
        scale = torch.maximum((max_pos - min_neg) / float(qmax - qmin), eps_t)
        zero_point = qmin - torch.round(min_neg / scale).to(torch.int64)
        zero_point = torch.clamp(zero_point, qmin, qmax)
    return scale, zero_point


def fixed_qparams_for_interval(lo: float, hi: float, qdtype: Union[QDtype, str] = "quint8") -> Tuple[float, int]:
    """The fixed (scale, zero_point) for an op whose output provably lies in ``[lo, hi]``.

    ``n`` codes split the interval evenly: ``scale = (hi - lo) / n`` and
    ``zero_point = qmin - round(lo / scale)``; see the API notes, section 2.

    >>> fixed_qparams_for_interval(0.0, 1.0, "quint8")
    (0.00390625, 0)
    >>> fixed_qparams_for_interval(-1.0, 1.0, "qint8")
    (0.0078125, 0)
    """
    qdtype = to_qdtype(qdtype)
    lo, hi = float(lo), float(hi)
    if not (torch.isfinite(torch.tensor([lo, hi])).all() and hi > lo):
        raise ValueError(f"fixed qparams need a finite interval with lo < hi, got [{lo}, {hi}]")
    scale = (hi - lo) / qdtype.levels
    zero_point = qdtype.quant_min - round(lo / scale)
    if not qdtype.quant_min <= zero_point <= qdtype.quant_max:
        # An interval that excludes 0 puts the zero point off the grid; clamp it and widen
        # the scale so the interval still fits from the clamped zero point.
        zero_point = min(max(zero_point, qdtype.quant_min), qdtype.quant_max)
        span_lo = (qdtype.quant_min - zero_point)
        span_hi = (qdtype.quant_max + 1 - zero_point)
        candidates = [lo / span_lo if span_lo < 0 else 0.0, hi / span_hi if span_hi > 0 else 0.0]
        scale = max(scale, *candidates)
    return scale, int(zero_point)


def per_batch_qparams(x: torch.Tensor, qdtype: QDtype, who: str) -> Tuple[float, int]:
    """Affine (scale, zero_point) of this tensor's own min and max (dynamic quantization: no calibration),
    :func:`calculate_qparams`'s values in Python numbers (its tensor steps cost 80 us a call, measured): each
    float32 step is computed in double and rounded once to float32, which gives the float32 result exactly.
    inf or NaN raise a ValueError naming ``who``, since a per-batch range needs finite values."""
    lo, hi = (float(v) for v in torch.aminmax(x.detach()))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"{who}: the input holds inf or nan; a per-batch range needs finite values")
    qmin, qmax = qdtype.quant_min, qdtype.quant_max
    min_neg, max_pos = min(lo, 0.0), max(hi, 0.0)
    scale = max(_float32(_float32(max_pos - min_neg) / float(qmax - qmin)), _EPS)
    zero_point = qmin - round(_float32(min_neg / scale))  # round half to even, as torch.round
    return scale, min(max(zero_point, qmin), qmax)


_EPS = float(torch.tensor(1e-8, dtype=torch.float32))


def _float32(value: float) -> float:
    return struct.unpack("f", struct.pack("f", value))[0]
