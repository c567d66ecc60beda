"""Run-time functions of lowered programs: the float boundary and pools in as few passes as possible.

A lowered program (:mod:`lucid_fx.passes.lower_to_program`) calls these plain functions directly,
with every argument decided when the program was built: no dispatcher, no input checks (the
program was built for these input shapes and dtypes) and no cached-weight lookups.

``quantize_codes`` gives the codes of :func:`lucid_fx.kernels.reference.quantize_per_tensor` bit for
bit in four passes (five for an odd zero point), without torch's float32 -> uint8 cast, the slow one
in torch 2.13 (98 us for 150k values against 12 us from int32, measured on an AVX512-VNNI EPYC).
Measured there, 1 thread: 78 against 212 us on 1x3x224x224, 27 against 72 us on 64x1024 (2.7x).
Programs call it where the native one-pass quantize (:mod:`lucid_fx.kernels.native`) is not loaded.

>>> x = torch.tensor([-1.0, 0.0, 0.5, 0.25, 9.0])
>>> quantize_codes(x, 1 / 0.1, 3, 0, 255, torch.uint8)
tensor([ 0,  3,  8,  5, 93], dtype=torch.uint8)
"""

from __future__ import annotations

import functools
import math
from typing import List, Tuple

import torch
import torch.nn.functional as F

from lucid_fx.kernels import attention, finite

__all__ = ["operand", "quantize_codes", "codes_need_clamp", "code_bounds", "centered", "requantize_codes", "add_codes", "mul_codes",
           "matmul_float", "matmul_codes", "softmax_table", "softmax_codes", "softmax_keep", "EXP_ONE", "max_pool_taps", "global_avg_pool_codes",
           "max_pool_taps_supported"]

# 1.5 * 2**23: adding it to a float32 below 2**22 in magnitude rounds it half to even and leaves the
# rounded integer in the low bits of the result's bit pattern.
MAGIC = 12582912.0


@functools.lru_cache(maxsize=4096)
def operand(value: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``value`` as a 0-dim tensor of ``dtype``, made once: the operand form of a number.

    torch 2.13 turns a Python number operand of ``mul_``/``add_``/``sub_``/``^`` into a tensor and
    a cast copy on every call (3.5 against 1.1 us for a 1024-element ``mul_``, measured); a 0-dim
    tensor of the other operand's dtype costs neither, and the arithmetic is the same (the number is
    rounded to float32 either way). Never written to: it is only ever the right-hand operand.

    >>> torch.equal(torch.tensor([1.0, 3.0]).mul_(operand(0.1)), torch.tensor([1.0, 3.0]).mul_(0.1))
    True
    """
    return torch.tensor(value, dtype=dtype)


def quantize_codes(x: torch.Tensor, inv_scale: float, zp: int, qmin: int, qmax: int, dtype: torch.dtype) -> torch.Tensor:
    """``clamp(round(x * inv_scale) + zp, qmin, qmax)`` as ``dtype``; NaN and ±inf are refused.

    ``clamp(round(v)) == round(clamp(v))`` for integer bounds, so the clamp comes first and only when
    the one ``aminmax`` (which also finds NaN and ±inf) says a value leaves the grid. ``v + MAGIC + zp``
    rounds ``v`` and leaves ``MAGIC + code`` in float32, whose int32 bits end in the code's byte; the
    int32 -> 8-bit narrowing keeps that byte. The add rounds ties to an even *sum*, an even
    ``round(v)`` only when ``zp`` is even, so an odd zero point rounds first (measured: 0 mismatches in
    10M near-tie values either way; without the separate round an odd zp gave 1-code errors)."""
    t = torch.mul(x, operand(inv_scale))
    if codes_need_clamp(t, qmin - zp, qmax - zp, x):  # looked up per call: benchmarks swap it
        t.clamp_(qmin - zp, qmax - zp)
    if zp % 2:
        t.round_()
    return t.add_(operand(MAGIC + zp)).view(torch.int32).to(dtype)


def codes_need_clamp(t: torch.Tensor, low: float, high: float, x: torch.Tensor) -> bool:
    """Whether ``t`` leaves ``[low, high]``; NaN and ±inf are refused (one ``aminmax``, which the clamp
    it can skip pays for: benchmarks/nonfinite_check.py measures the difference)."""
    lo, hi = torch.aminmax(t)
    lo, hi = lo.item(), hi.item()
    if not (math.isfinite(lo) and math.isfinite(hi)):
        finite.refuse_nonfinite("quantize_per_tensor", x)  # raises unless a finite x overflowed x * inv_scale
    return lo < low or hi > high


def requantize_codes(y: torch.Tensor, zp: int, low: int, high: int, dtype: torch.dtype) -> torch.Tensor:
    """``clamp(round(y) + zp, low, high)`` as ``dtype``, in place on float32 ``y``, without the float32 ->
    8-bit cast (143 against 25 us for 113k values, measured): the codes of ``cpu_float._requantize``."""
    y = y.clamp_(low - zp, high - zp)  # integer bounds: clamping before rounding gives the same codes
    if zp % 2:
        y = y.round_()
    return y.add_(operand(MAGIC + zp)).view(torch.int32).to(dtype)


def code_bounds(dtype: torch.dtype, zp: int, post_op: str) -> Tuple[int, int]:
    """The clamp bounds of codes of ``dtype``: relu in real numbers is a floor at the zero point
    (``round(max(v, 0)) == max(round(v), 0)``)."""
    info = torch.iinfo(dtype)
    return (max(zp, info.min) if post_op == "relu" else info.min), info.max


def centered(q: torch.Tensor, zp: int) -> torch.Tensor:
    """``q - zp`` in float32 (exact for 8-bit codes)."""
    y = q.to(torch.float32)
    return y.sub_(operand(zp)) if zp else y


def add_codes(qa, a_zp: int, a_mult: float, qb, b_zp: int, b_mult: float, zp: int, low: int, high: int, dtype):
    """``cpu_float.add`` with its multipliers (``a_scale / out_scale``, ...) and clamp bounds decided once."""
    y = torch.add(centered(qa, a_zp).mul_(operand(a_mult)), centered(qb, b_zp), alpha=b_mult)
    return requantize_codes(y, zp, low, high, dtype)


def mul_codes(qa, a_zp: int, qb, b_zp: int, mult: float, zp: int, low: int, high: int, dtype):
    """``cpu_float.mul`` with its multiplier (``a_scale * b_scale / out_scale``) and clamp bounds decided once."""
    y = torch.mul(centered(qa, a_zp), centered(qb, b_zp))
    return requantize_codes(y.mul_(operand(mult)), zp, low, high, dtype)


def matmul_float(qa, a_zp: int, qb, b_zp: int) -> torch.Tensor:
    """The float32 product of two centred code tensors, which :func:`matmul_codes` requantizes."""
    return torch.matmul(centered(qa, a_zp), centered(qb, b_zp))


def matmul_codes(qa, a_zp: int, qb, b_zp: int, mult: float, zp: int, low: int, high: int, dtype):
    """``cpu_float.matmul`` with its multiplier and clamp bounds decided once."""
    return requantize_codes(matmul_float(qa, a_zp, qb, b_zp).mul_(operand(mult)), zp, low, high, dtype)


def masked_softmax_float(q, zp: int, scale: float, mask: torch.Tensor, fill, dim: int) -> torch.Tensor:
    """``cpu_float.masked_softmax``'s float32 probabilities (a row masked everywhere with -inf as zeros),
    which the program requantizes in one pass (``native.requantize_scaled``)."""
    y = attention.apply_mask(centered(q, zp).mul_(operand(scale)), mask, fill)
    return torch.softmax(y, dim).nan_to_num_(nan=0.0)


#: The fixed point of :func:`softmax_table`: a row's largest code's exponential, exactly.
EXP_ONE = 2 ** 23


@functools.lru_cache(maxsize=1024)
def softmax_table(scale: float) -> torch.Tensor:
    """``round(exp(-d * scale) * 2**23)`` for ``d = 0..255`` (int32, read only): the exponential of a
    code ``d`` steps below its row's largest, within ``2**-24`` of the float one, so the softmax of
    8-bit codes needs no ``exp`` at run time and sums exactly."""
    d = torch.arange(256, dtype=torch.float64)
    return torch.round(torch.exp(d * -scale) * EXP_ONE).to(torch.int32)


def softmax_codes(q, table: torch.Tensor, dim: int, inv_out_scale: float, zp: int, low: int, high: int, dtype,
                  keep=None):
    """Codes of the softmax of ``scale * q`` along ``dim`` (``table``: :func:`softmax_table` of ``scale``):
    ``e = table[max - q]``, summed exactly in int64, ``e * float32(1 / sum)``, requantized. A shift
    of the codes cancels, so the zero point is never subtracted. With ``keep`` (bool, ``q``'s shape)
    only the positions it marks count, and a row with none is all zero probability, as a row masked
    everywhere with -inf (:func:`softmax_keep`). ``softmax_native.c`` makes the same steps in one pass."""
    wide = q.to(torch.int32)
    top = (wide if keep is None else wide.masked_fill(~keep, -256)).amax(dim, keepdim=True)
    e = table[(top - wide).clamp_(0, 255).to(torch.int64)]
    if keep is not None:
        e = e.masked_fill_(~keep, 0)
    inverse = torch.reciprocal(e.sum(dim, keepdim=True, dtype=torch.int64).to(torch.float64)).to(torch.float32)
    y = e.to(torch.float32).mul_(inverse)
    if keep is not None:
        y = y.nan_to_num_(nan=0.0)  # a row with nothing kept: 0 * inf
    return requantize_codes(y.mul_(operand(inv_out_scale)), zp, low, high, dtype).contiguous()  # as torch.softmax


def softmax_keep(q: torch.Tensor, scale: float, mask: torch.Tensor, fill, dim: int):
    """Where ``masked_softmax(q, mask, fill)`` along the last dim is :func:`softmax_codes` over a subset
    of each row: the positions that count (bool, ``q``'s shape). That holds for a mask of 0 and of
    values that leave ``exp`` exactly 0 in float32 past any score (below ``-104 - 255 * scale``: -inf,
    ``finfo.min``, -1e9, -1e4), and for a row masked everywhere with one value: the plain softmax if
    it is finite (a shift cancels), zeros if it is -inf. None otherwise (a bias, another dim, a mask
    that broadcasts ``q``, a row ``masked_fill`` sets everywhere to a finite value, which is uniform):
    the float route then."""
    if dim % q.dim() != q.dim() - 1 or mask.dim() > q.dim() or any(
            m not in (1, n) for m, n in zip(reversed(mask.shape), reversed(q.shape))):
        return None
    bound = -104.0 - 255.0 * scale
    if fill is not None:  # masked_fill(mask, fill) of a bool mask
        if not fill <= bound:
            return None
        keep = ~mask
        if math.isfinite(fill) and not bool(keep.any(-1).all()):
            return None  # a row filled everywhere with one value is uniform, whatever the scores
        return keep.expand(q.shape)
    keep = mask == 0
    if not bool((keep | (mask <= bound)).all()):
        return None
    everywhere = ~keep.any(-1, keepdim=True)
    if bool(everywhere.any()):
        low, high = mask.amin(-1, keepdim=True), mask.amax(-1, keepdim=True)
        if not bool((low == high)[everywhere].all()):
            return None  # masked everywhere with several values: the largest win, in float
        keep = keep | (everywhere & (high > float("-inf")))
    return keep.expand(q.shape)


def max_pool_taps_supported(kernel: List[int], stride: List[int], padding: List[int], dilation: List[int],
                            ceil_mode: bool) -> bool:
    """Geometries :func:`max_pool_taps` computes exactly: no dilation or ceil mode, padding below half
    the window (so every window holds a real element, and the padding code never wins)."""
    return (not ceil_mode and list(dilation) in ([1, 1], [1]) and len(kernel) == 2
            and all(2 * p < k for p, k in zip(padding, kernel)))


def max_pool_taps(q: torch.Tensor, kernel: List[int], stride: List[int], padding: List[int]) -> torch.Tensor:
    """``max_pool2d`` of 8-bit codes as the maximum of strided views of the padded codes, rows then
    columns: 136-164 against 482 us for lucid_fx's int16 kernel on 1x64x112x112, 3x3/2 (measured)."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    h, w = q.shape[-2], q.shape[-1]
    oh, ow = (h + 2 * ph - kh) // sh + 1, (w + 2 * pw - kw) // sw + 1
    lowest = 0 if q.dtype == torch.uint8 else -128
    padded = F.pad(q, (pw, pw, ph, ph), value=lowest) if ph or pw else q
    rows = padded[..., 0:sh * (oh - 1) + 1:sh, :]
    for i in range(1, kh):
        rows = torch.maximum(rows, padded[..., i:i + sh * (oh - 1) + 1:sh, :])
    out = rows[..., 0:sw * (ow - 1) + 1:sw]
    for j in range(1, kw):
        out = torch.maximum(out, rows[..., j:j + sw * (ow - 1) + 1:sw])
    return out


def global_avg_pool_codes(q: torch.Tensor, scale: float, zp: int, out_scale: float, out_zp: int) -> torch.Tensor:
    """``adaptive_avg_pool2d(q, 1)`` of codes: an exact int32 sum, then one requantization of N x C
    values (1.3-1.8x faster than the float kernel, measured; at most one code from it, at ties)."""
    hw = q.shape[-1] * q.shape[-2]
    qmin, qmax = (0, 255) if q.dtype == torch.uint8 else (-128, 127)
    y = q.sum((-2, -1), keepdim=True, dtype=torch.int32).to(torch.float32)
    y = y.sub_(operand(zp * hw)).mul_(operand(scale / (out_scale * hw)))
    return requantize_codes(y, out_zp, qmin, qmax, q.dtype)  # clamp(round(y) + out_zp), without the casts
