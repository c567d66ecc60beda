"""Table lookups on 8-bit codes in native passes (native.c): one table (:func:`lut`, 8-bit codes or float32
out), or two tables and their product (:func:`lut_mul_codes`, a gated MLP's ``act(x) * gate(y)``), each the
reference's values bit for bit in one pass; :func:`lut_plan` is a program's step (passes/plan_program_calls.py)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lucid_fx.kernels import program_ops
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.native import _CODES, _function, bind
from lucid_fx.kernels.native_step import BUFFER, IN, native_step

__all__ = ["lut", "lut_plan", "lut_vectorized", "lut_mul_codes"]


def lut_vectorized() -> bool:
    """Whether this build looks 8-bit tables up in vectors: AVX512-VBMI 64 codes a step (14 against 145 us for the
    pair table's 1x32x112x112 codes), AVX2 32 (279 against 468 us for 2^20 codes, EPYC); else a scalar loop."""
    return bool(_function("lut", "vectorized"))


def lut(q: torch.Tensor, table: torch.Tensor) -> Optional[torch.Tensor]:
    """``table[code]`` for 8-bit codes ``q`` on the CPU and a 256-entry ``table`` (8-bit codes or float32),
    in ``q``'s layout where it is dense (else contiguous, as the reference's): :func:`lucid_fx.kernels.reference.lut`'s
    values. None where the native kernels are not loaded or do not take these operands."""
    if not (q.is_cpu and table.is_cpu):
        return None
    step = lut_plan(q, table)
    if step is None:  # not dense (a slice): one copy first, the reference's contiguous layout
        q = q.contiguous()
        step = lut_plan(q, table)
    return None if step is None else step(q, table)


def lut_plan(q: torch.Tensor, table: torch.Tensor) -> Optional[Callable]:
    """:func:`lut`'s native call for dense codes laid out as ``q`` and a table like ``table``, checked once:
    ``step(q, table)``, or None for codes of other strides. None where the native kernel does not take them."""
    strides, dtype = q.stride(), table.dtype
    if (q.dtype not in _CODES or not q.is_cpu or not table.is_cpu or table.numel() != 256 or not table.is_contiguous()
            or torch.empty_like(q, dtype=dtype).stride() != strides):
        return None
    call = bind("lut", dtype, q.numel(), _flip(q))
    if call is None:
        return None
    return native_step(call, [(q.shape, strides, q.dtype), (table.shape, table.stride(), dtype)], [(q.shape, strides, dtype)],
                       [(IN, 0), (IN, 1), (BUFFER, 0)])


def _flip(q: torch.Tensor) -> int:
    return 128 if q.dtype == torch.int8 else 0


def lut_mul_codes(qa, table_a, a_zp: int, qb, table_b, b_zp: int, mult: float, zp: int, low: int, high: int, dtype):
    """``program_ops.mul_codes(lut(qa, table_a), a_zp, lut(qb, table_b), b_zp, ...)`` in one pass (a
    gated MLP's ``act(x) * gate(y)``): the same codes, bit for bit. ``qa`` and ``qb`` are 8-bit codes
    of one shape and layout, the tables 256 codes of ``dtype``."""
    fn = _function("lut_mul", dtype)
    if (fn is None or qa.shape != qb.shape or qa.stride() != qb.stride() or qa.dtype not in _CODES
            or qb.dtype not in _CODES or not qa.is_cpu or table_a.dtype != dtype or table_b.dtype != dtype):
        return program_ops.mul_codes(ref.lut(qa, table_a), a_zp, ref.lut(qb, table_b), b_zp, mult, zp, low, high, dtype)
    out = torch.empty_like(qa, dtype=dtype)
    if out.stride() != qa.stride():  # not dense
        return program_ops.mul_codes(ref.lut(qa, table_a), a_zp, ref.lut(qb, table_b), b_zp, mult, zp, low, high, dtype)
    fn(qa.data_ptr(), table_a.data_ptr(), _flip(qa), qb.data_ptr(), table_b.data_ptr(), _flip(qb), out.data_ptr(),
       qa.numel(), a_zp, b_zp, mult, zp, low, high)
    return out
