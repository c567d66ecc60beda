"""The portable ``lucid_fx::linear``'s small-linear constants, kept per weight (:func:`kept_row_linear`).

A program builds a linear's :class:`~lucid_fx.kernels.linear_row.RowLinear` once, when it is planned; the portable op
(what a model runs past its program signatures, ``lucid_fx.kernels.cpu.linear``) built it on every call from that
call's scale and bias: the zero-point fold, the offsets, the scales' product. Kept, a call costs (AMX Xeon, 2
threads, us) 58 against 79 at 64 x 1024 x 1024 and 22.6 against 38.5 at 8 x 256 x 256.
"""

from __future__ import annotations

from typing import Optional

import torch

from lucid_fx.kernels.int_mm import PREPARED
from lucid_fx.kernels.linear_row import RowLinear, few_rows_engine_here, row_linear

__all__ = ["kept_row_linear"]


def kept_row_linear(qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor], x_scale: float, x_zp: int,
                    out_scale: Optional[float], engine: str, post_op: str, rows: int) -> Optional[RowLinear]:
    """:func:`~lucid_fx.kernels.linear_row.row_linear` of these arguments, built once per weight (at its version) and
    kept with the very scale and bias tensors it was built from, at their versions: a replaced tensor (held by the
    entry, so no other takes its identity) or one changed in place builds it again. ``rows`` and the thread count
    count only where they choose the float steps (an AMX CPU's oneDNN, ``onednn_steps.linear_steps``)."""
    amx = few_rows_engine_here() is not None
    key = ("portable row", engine, post_op, x_scale, x_zp, out_scale, *((rows, torch.get_num_threads()) if amx else ()))
    kept = PREPARED.get(qw, key, lambda: [None])
    stamp = (w_scale, w_scale._version, bias, None if bias is None else bias._version)
    old = kept[0]
    if old is None or not (old[0][0] is w_scale and old[0][1] == stamp[1] and old[0][2] is bias and old[0][3] == stamp[3]):
        kept[0] = old = (stamp, row_linear(qw, w_scale, bias, x_scale, x_zp, out_scale, engine, post_op, rows))
    return old[1]
