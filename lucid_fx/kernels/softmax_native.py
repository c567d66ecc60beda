"""The softmax of 8-bit codes in one native pass (``native_softmax.c``): per row the largest code,
each exponential read from :func:`lucid_fx.kernels.program_ops.softmax_table`, an exact int64 sum
and one reciprocal, then the codes. :func:`lucid_fx.kernels.program_ops.softmax_codes` makes the
same steps with torch ops and gives the same codes bit for bit; it runs where the native kernels
are not loaded or the codes are not dense.

Measured on an AVX2 EPYC, one thread, 8x4x128x128 uint8 codes (the encoder's attention), fastest
of 30 in two runs: 0.65 and 0.8 ms, where ``torch.softmax`` on the float32 scores and one native
requantizing pass took 1.16 and 0.9. Of the 0.7 ms, the table lookups take about 0.4 (AVX2 gathers;
scalar loads measured 0.1 ms less), the requantizing pass 0.2, the row maxima and sums 0.1. With
AVX512-VBMI the lookups are byte permutes of the table's three low bytes, 64 codes a step: 0.36-0.42
ms against 0.50-0.57 with gathers, on an AVX512-VNNI EPYC.

>>> q = torch.tensor([[0, 10, 20]], dtype=torch.uint8)  # scores 0, 1, 2 at scale 0.1
>>> softmax_codes(q, program_ops.softmax_table(0.1), -1, 256.0, 0, 0, 255, torch.uint8)  # out scale 1/256
tensor([[ 23,  63, 170]], dtype=torch.uint8)
"""

from __future__ import annotations

import torch

from lucid_fx.kernels import native, program_ops
from lucid_fx.kernels.native import _function

__all__ = ["softmax_codes", "masked_softmax_codes", "table_keep", "TABLE_MIN"]


def softmax_codes(q, table: torch.Tensor, dim: int, inv_out_scale: float, zp: int, low: int, high: int, dtype,
                  keep=None):
    """:func:`lucid_fx.kernels.program_ops.softmax_codes` in one native pass where ``q`` is dense."""
    fn = _function("softmax", dtype)
    if fn is None or q.dtype != dtype or not q.is_cpu or not q.is_contiguous() or q.dim() == 0:
        return program_ops.softmax_codes(q, table, dim, inv_out_scale, zp, low, high, dtype, keep)
    d = dim % q.dim()
    outer, n = q.shape[:d].numel(), q.shape[d]
    out = torch.empty_like(q)
    kept = None if keep is None else keep.contiguous()  # one byte per code, q's layout
    if out.numel() and fn(q.data_ptr(), None if kept is None else kept.data_ptr(), table.data_ptr(), out.data_ptr(),
                          outer, n, q.shape[d + 1:].numel(), inv_out_scale, zp, low, high):
        raise MemoryError("lucid_fx: the native softmax could not allocate a row's exponentials")
    return out


#: Scores from which a masked softmax takes the table route. Measured on an AVX2 EPYC (one thread,
#: the two routes taking turns, padding masks): the table route 0.5-0.68 of the float route's time
#: at 2**18 and 2**19 scores, 1.2-1.6 times it at 2**11-2**17, where checking the mask (some ten small
#: torch ops) costs more than the float route saves. (Why the float route slows past 2**18, 1 MiB of
#: float32 scores: perhaps the L2 cache; not measured.)
TABLE_MIN = 2 ** 18


def table_keep(q, scale: float, mask, fill, dim: int, minimum: int = TABLE_MIN):
    """The positions a mask leaves (``program_ops.softmax_keep``) where the table route pays, from
    ``minimum`` scores (:data:`TABLE_MIN` for the softmax; softmax_matmul.py has its own); None for the
    float route."""
    return program_ops.softmax_keep(q, scale, mask, fill, dim) if q.numel() >= minimum else None


def masked_softmax_codes(q, scale: float, zp: int, mask, fill, dim: int, inv_out_scale: float, out_zp: int,
                         low: int, high: int, dtype):
    """``lucid_fx::masked_softmax``'s codes on the CPU: from :data:`TABLE_MIN` scores, the table softmax
    over the positions the mask leaves where it is a mask (``program_ops.softmax_keep``: padding and
    causal masks, -inf or a very negative fill), else the float route (the scores plus the mask, in
    float32, as for a bias)."""
    keep = table_keep(q, scale, mask, fill, dim)
    if keep is not None:
        return softmax_codes(q, program_ops.softmax_table(scale), dim, inv_out_scale, out_zp, low, high, dtype, keep)
    y = program_ops.masked_softmax_float(q, zp, scale, mask, fill, dim)
    return native.requantize_scaled(y, inv_out_scale, out_zp, low, high, dtype)
