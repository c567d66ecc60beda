"""A linear's float32 result plus a residual in one GEMM: the residual added in the float steps (oneDNN's binary "add"
post-op; on lucid_fx's GEMM, :data:`lucid_fx.kernels.linear_native.ADDEND`), the same float32 sum as ``torch.add`` of
the two. A transformer's ``x + proj(attn)`` and ``h + fc2(act)``: the encoder block of benchmarks/models.py on an AMX
Xeon (1024 rows, 2 threads), fc2 and proj: the GEMM then torch.add 253 and 139 us, in one 203 and 114 (oneDNN's call
with its binary post-op: 189 and 108; the model as fast either way)."""

from __future__ import annotations

import torch

from lucid_fx.kernels.linear_native import ADDEND
from lucid_fx.kernels.linear_row import RowLinear, gemm_plan, linear_rows

__all__ = ["linear_rows_add"]


def linear_rows_add(q: torch.Tensor, other: torch.Tensor, row: RowLinear, low: float, high: float) -> torch.Tensor:
    """``linear_rows(q, row, 0, low, high, float32) + other`` for codes ``q`` (..., K) and float32 ``other`` of the
    result's shape: in the GEMM where it takes them (contiguous, lucid_fx's GEMM loaded), else the two steps."""
    n = getattr(row.weight, "n", None)
    step = None if n is None or not q.is_contiguous() else gemm_plan(
        q, row, 0, low, high, torch.float32, (*q.shape[:-1], n), torch.contiguous_format, ADDEND)
    out = None if step is None else step(q, other)
    return out if out is not None else torch.add(linear_rows(q, row, 0, low, high, torch.float32), other)
