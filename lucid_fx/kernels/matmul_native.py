"""The product of two 8-bit code tensors (attention's ``q @ k^T`` and ``p @ v``) in lucid_fx's own
kernel (``native_matmul.c``): exact int32 sums, then :func:`lucid_fx.kernels.program_ops.matmul_codes`'s
float32 multiply and requantization, so its codes bit for bit wherever that function's float32 sums
are exact too (every partial sum within 2^24: ``k * max|a - a_zp| * max|b - b_zp| <= 2^24``, checked
when the plan is made). The torch route centres both operands in float32 (two casts, two
subtractions, copies of strided views), multiplies and requantizes: some ten ops where this is one.

>>> a = torch.tensor([[[130, 126]]], dtype=torch.uint8)  # values 2 and -2 (zero point 128)
>>> b = torch.tensor([[[1], [3]]], dtype=torch.uint8)  # values 1 and 3 (zero point 0)
>>> plan = matmul_plan(a, b, 128, 0)
>>> matmul_codes(a, 128, b, 0, 1.0, 100, 0, 255, torch.uint8, plan)  # 2 * 1 - 2 * 3 = -4, on zero point 100
tensor([[[96]]], dtype=torch.uint8)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

from lucid_fx.kernels import native
from lucid_fx.kernels.native import _function
from lucid_fx.kernels.native_step import BUFFER, IN, native_step, returns_step

__all__ = ["MatmulPlan", "matmul_plan", "matmul_codes", "matmul_step", "EXACT_SUM", "MAX_BATCH_DIMS"]

EXACT_SUM = 2 ** 24  # the largest partial sum float32 holds exactly
MAX_BATCH_DIMS = 4


@dataclass(frozen=True)
class MatmulPlan:
    """A product's geometry for native_matmul.c, decided when the program is built: the strides the
    operands must have at run time, the output's shape, and the C loop's sizes and strides."""

    a_stride: Tuple[int, ...]
    b_stride: Tuple[int, ...]
    out_shape: Tuple[int, ...]
    geometry: torch.Tensor  # int64: 4 batch sizes, m, n, k; a's 4 batch strides, row, column; b's


def _span(dtype: torch.dtype, zp: int) -> int:
    """The largest ``|code - zp|`` of ``dtype``."""
    info = torch.iinfo(dtype)
    return max(zp - info.min, info.max - zp)


def _batch_strides(t: torch.Tensor) -> list:
    """``t``'s strides along its batch dims, padded to ``MAX_BATCH_DIMS``, 0 where it broadcasts."""
    lead = MAX_BATCH_DIMS - t.dim() + 2
    sizes, strides = t.shape[:-2], t.stride()[:-2]
    return [0] * lead + [0 if size == 1 else stride for size, stride in zip(sizes, strides)]


def matmul_plan(a: torch.Tensor, b: torch.Tensor, a_zp: int, b_zp: int, limit: int = EXACT_SUM) -> Optional[MatmulPlan]:
    """The plan for ``a @ b`` of these (fake or real) 8-bit codes; None where the kernel does not take
    them (fewer than 2 or more than ``MAX_BATCH_DIMS`` + 2 dims, other dtypes, an empty dim, or sums
    past ``limit``: by default those float32 would round, as the torch route does)."""
    if a.dim() < 2 or b.dim() < 2 or a.dtype != b.dtype or a.dtype not in (torch.uint8, torch.int8):
        return None
    try:
        batch = tuple(torch.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except RuntimeError:
        return None
    (m, k), (k_b, n) = a.shape[-2:], b.shape[-2:]
    if len(batch) > MAX_BATCH_DIMS or k != k_b or k * _span(a.dtype, a_zp) * _span(b.dtype, b_zp) > limit:
        return None
    if 0 in (m, n, k, *batch):  # nothing to sum or nothing to write: the torch route's empty or zero result
        return None
    sizes = [1] * (MAX_BATCH_DIMS - len(batch)) + list(batch)
    geometry = sizes + [m, n, k] + _batch_strides(a) + list(a.stride()[-2:]) + _batch_strides(b) + list(b.stride()[-2:])
    return MatmulPlan(tuple(a.stride()), tuple(b.stride()), (*batch, m, n), torch.tensor(geometry, dtype=torch.int64))


@returns_step("qa", "qb")
def matmul_codes(qa, a_zp: int, qb, b_zp: int, mult: float, zp: int, low: int, high: int, dtype, matmul: MatmulPlan,
                 plan: Optional[Callable] = None):
    """:func:`lucid_fx.kernels.program_ops.matmul_codes` in one call, for operands with the strides of
    ``matmul``: its codes bit for bit, contiguous as its are. ``plan``: :func:`matmul_step`'s."""
    out = None if plan is None else plan(qa, qb)
    if out is not None:
        return out
    fn = _function("matmul", dtype)
    if (fn is None or qa.dtype != dtype or qb.dtype != dtype or qa.stride() != matmul.a_stride
            or qb.stride() != matmul.b_stride or not qa.is_cpu or not qb.is_cpu):
        return native.matmul_codes(qa, a_zp, qb, b_zp, mult, zp, low, high, dtype)
    out = torch.empty(matmul.out_shape, dtype=dtype)
    if fn(qa.data_ptr(), qb.data_ptr(), out.data_ptr(), matmul.geometry.data_ptr(), a_zp, b_zp, mult, None, zp, low, high):
        raise MemoryError("lucid_fx: the native matmul could not allocate its int16 operands")
    return out


def matmul_step(qa, a_zp: int, qb, b_zp: int, mult: float, zp: int, low: int, high: int, dtype,
                matmul: MatmulPlan) -> Optional[Callable]:
    """A program's plan of :func:`matmul_codes`: its native call as a native step (native_step.py) for operands of
    these shapes and ``matmul``'s strides, ``step(qa, qb)``; it returns None where the kernel could not allocate
    (its status), so that ``matmul_codes`` raises."""
    call = native.bind("matmul", dtype, a_zp, b_zp, mult, zp, low, high)
    if call is None or qa.dtype != dtype or qb.dtype != dtype:
        return None
    out_strides = torch.empty(matmul.out_shape, device="meta").stride()
    return native_step(call, [(qa.shape, matmul.a_stride, dtype), (qb.shape, matmul.b_stride, dtype)],
                       [(matmul.out_shape, out_strides, dtype)],
                       [(IN, 0), (IN, 1), (BUFFER, 0), matmul.geometry.data_ptr(), None], keep=matmul)
