"""The float-to-int8 boundary: ``lucid_fx::quantize_per_tensor`` refusing NaN and ±inf.

The codes are :func:`lucid_fx.kernels.reference.quant`'s, bit for bit: ``clamp(round(x * (1 /
scale)) + zero_point)``. On the CPU the native pass (:mod:`lucid_fx.kernels.native`) computes them
and counts NaN and ±inf in the same loop. Without it the finite check rides on the torch kernels'
pass: one ``aminmax`` of the unclamped codes finds NaN or ±inf (they stay non-finite through the
multiply and the round) and also says whether the clamp is needed at all, so a value inside the
grid skips it. What each costs is in docs/policies.md (``benchmarks/nonfinite_check.py``).

On CUDA, where reading the min and max back would stall the stream, the input is checked with
``torch._assert_async`` (:func:`lucid_fx.kernels.finite.require_finite`) and the clamp always runs."""

from __future__ import annotations

import math

import torch

from lucid_fx.kernels import checks, finite, native
from lucid_fx.kernels import reference as ref

__all__ = ["quantize_per_tensor", "quantize_per_channel"]


def codes_need_clamp(codes: torch.Tensor, quant_min: int, quant_max: int, x: torch.Tensor) -> bool:
    """Whether unclamped ``codes`` leave ``[quant_min, quant_max]``; raises if ``x`` holds NaN or ±inf.

    A finite ``x`` can still overflow ``x * (1 / scale)`` to ±inf (|x| near float32's max): the
    count on ``x`` tells the two apart, and such codes are clamped like any other."""
    lo, hi = torch.aminmax(codes)
    lo, hi = lo.item(), hi.item()
    if not (math.isfinite(lo) and math.isfinite(hi)):
        finite.refuse_nonfinite("quantize_per_tensor", x)
        return True
    return lo < quant_min or hi > quant_max


def quantize_per_tensor(
    x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`lucid_fx.kernels.reference.quantize_per_tensor`, refusing NaN and ±inf in ``x``."""
    if checks.is_async(x) or not x.is_floating_point() or x.numel() == 0:
        finite.require_finite("quantize_per_tensor", x)
        return ref.quantize_per_tensor(x, scale, zero_point, quant_min, quant_max, dtype)
    ref._check_range(quant_min, quant_max, dtype)
    if native.takes(x, dtype) and native.available():  # one pass in C, the finite check included
        return native.quantize_codes(x, ref.f32_reciprocal(scale), zero_point, quant_min, quant_max, dtype)
    y32 = x.to(torch.float32)
    codes = (y32.mul_(ref.f32_reciprocal(scale)) if y32 is not x else y32 * ref.f32_reciprocal(scale)).round_()
    if zero_point:
        codes.add_(zero_point)
    if codes_need_clamp(codes, quant_min, quant_max, x):
        codes.clamp_(quant_min, quant_max)
    return codes.to(dtype)


def quantize_per_channel(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, quant_min: int, quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`lucid_fx.kernels.reference.quantize_per_channel`, refusing NaN and ±inf in ``x`` (one ``aminmax``)."""
    finite.require_finite("quantize_per_channel", x)
    return ref.quantize_per_channel(x, scale, zero_point, axis, quant_min, quant_max, dtype)
