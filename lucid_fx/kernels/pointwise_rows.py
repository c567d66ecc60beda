"""1x1 convolutions of stride 1 on lucid_fx's GEMM: each pixel of channels-last codes is a row of
:func:`lucid_fx.kernels.linear_row.linear_row`, read in place, the result written in the image's layout; with a
residual added as oneDNN's "sum" post-op adds it (:func:`pointwise_rows_sum`). Each has a ``*_plan`` twin a program
calls (passes/plan_program_calls.py)."""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from lucid_fx.kernels.linear_row import RowLinear, gemm_plan, linear_row
from lucid_fx.kernels.native_step import returns_step

__all__ = ["pointwise_rows", "pointwise_rows_plan", "pointwise_rows_sum", "pointwise_rows_sum_plan"]


@returns_step("q")
def pointwise_rows(q: torch.Tensor, row: RowLinear, zp: int, low: float, high: float,
                   dtype: torch.dtype, plan: Optional[Callable] = None) -> torch.Tensor:
    """:func:`linear_row` of each pixel of 4-d channels-last codes ``q`` (a 1x1 convolution of stride 1,
    or squeeze-excite's of a 1x1 image): the result (N, N_out, H, W), channels-last (contiguous for a
    1x1 image, as a linear's result viewed so). On lucid_fx's GEMM the pixels are its rows in place
    and it writes the result's storage: the views to rows and back took six torch calls a convolution.
    ``plan``: :func:`pointwise_rows_plan`'s."""
    if plan is None:
        plan = pointwise_rows_plan(q, row, zp, low, high, dtype)
    out = None if plan is None else plan(q)
    if out is not None:
        return out
    n, c, h, w = q.shape
    out = linear_row(q.permute(0, 2, 3, 1).reshape(-1, c), row, zp, low, high, dtype)
    return out.view(n, h, w, -1).permute(0, 3, 1, 2) if h * w > 1 else out.view(n, -1, 1, 1)


def pointwise_rows_plan(q: torch.Tensor, row: RowLinear, zp: int, low: float, high: float, dtype: torch.dtype,
                        residual: Optional[Tuple[float, int]] = None) -> Optional[Callable]:
    """:func:`pointwise_rows`' GEMM call for codes laid out as ``q`` (``residual``: :func:`pointwise_rows_sum`'s,
    the residual's scale and zero point), checked once: ``step(q)`` (``step(q, other)``), or None for codes of
    other strides. None where lucid_fx's GEMM does not take them."""
    if q.dim() != 4 or not q.is_contiguous(memory_format=torch.channels_last):
        return None
    n, _, h, w = q.shape
    layout = torch.channels_last if h * w > 1 or residual is not None else torch.contiguous_format
    return gemm_plan(q, row, zp, low, high, dtype, (n, row.weight.n, h, w), layout, residual)


@returns_step("q", "other")
def pointwise_rows_sum(q: torch.Tensor, row: RowLinear, other: torch.Tensor, other_scale: float, other_zp: int, zp: int,
                       low: float, high: float, plan: Optional[Callable] = None) -> torch.Tensor:
    """:func:`pointwise_rows` into uint8 codes plus a residual ``other`` (uint8 codes of the result's
    shape, channels-last), as oneDNN's 1x1 convolution with its "sum" post-op adds it: the same codes
    (its kernels' arithmetic, :func:`lucid_fx.kernels.linear_native.gemm_into`), into a new
    tensor where oneDNN writes into a copy of ``other``. Programs call it on lucid_fx's GEMM only.
    ``plan``: :func:`pointwise_rows_sum_plan`'s."""
    if plan is None:
        plan = pointwise_rows_sum_plan(q, row, other, other_scale, other_zp, zp, low, high)
    out = None if plan is None else plan(q, other)
    if out is None:
        raise RuntimeError("lucid_fx: a program's 1x1 convolution with a residual met inputs other than those it was "
                           "built for (channels-last uint8 codes on lucid_fx's native GEMM): a bug in lucid_fx, please "
                           "report it")
    return out


def pointwise_rows_sum_plan(q: torch.Tensor, row: RowLinear, other: torch.Tensor, other_scale: float, other_zp: int,
                            zp: int, low: float, high: float) -> Optional[Callable]:
    """:func:`pointwise_rows_sum`'s GEMM call, checked once: ``step(q, other)`` (:func:`pointwise_rows_plan`)."""
    return pointwise_rows_plan(q, row, zp, low, high, torch.uint8, (other_scale, other_zp))
