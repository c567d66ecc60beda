"""A program's row-engine linears with their GEMM call bound when the program is built, as its matmuls' plans are
(:func:`planned_step`): ``linear_rows`` planned it on every call (:func:`~lucid_fx.kernels.linear_row.gemm_plan`:
the native call's scalars bound, the result's strides asked of a meta tensor): on an AMX Xeon (2 threads) 16.1 against
10.5 us a call at 8 rows of 256 -> 768, 143 against 135 at the encoder block's 1024. Rows of another shape or layout
than the planned ones take the unplanned route, with the same values."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lucid_fx.kernels.linear_add import linear_rows_add
from lucid_fx.kernels.linear_native import Residual
from lucid_fx.kernels.linear_row import RowLinear, gemm_plan, linear_rows
from lucid_fx.kernels.native_step import returns_step

__all__ = ["planned_step", "planned_rows", "planned_rows_add"]


def planned_step(q: torch.Tensor, row: RowLinear, zp: int, low: float, high: float, dtype: torch.dtype,
                 residual: Optional[Residual] = None) -> Optional[Callable]:
    """``gemm_plan``'s step for contiguous CPU rows of ``q``'s shape (any rank, K last; ``q`` itself may be a meta
    tensor), which returns None for rows of any other shape, strides or device; None where lucid_fx's GEMM does not
    take them."""
    n = getattr(row.weight, "n", None)
    if n is None or not q.is_contiguous():
        return None
    return gemm_plan(q, row, zp, low, high, dtype, (*q.shape[:-1], n), torch.contiguous_format, residual)  # a native
    # step: it checks the rows' (and residual's) shape, strides and device


@returns_step("q", step="step")
def planned_rows(q: torch.Tensor, row: RowLinear, step: Optional[Callable], zp: int, low: float, high: float,
                 dtype: torch.dtype) -> torch.Tensor:
    """``linear_rows(q, row, zp, low, high, dtype)`` by ``step`` (:func:`planned_step`'s) where it takes ``q``."""
    out = None if step is None else step(q)
    return out if out is not None else linear_rows(q, row, zp, low, high, dtype)


@returns_step("q", "other", step="step")
def planned_rows_add(q: torch.Tensor, other: torch.Tensor, row: RowLinear, step: Optional[Callable], low: float,
                     high: float) -> torch.Tensor:
    """``linear_rows_add(q, other, row, low, high)`` by ``step`` (planned with ADDEND) where it takes them."""
    out = None if step is None else step(q, other)
    return out if out is not None else linear_rows_add(q, other, row, low, high)
