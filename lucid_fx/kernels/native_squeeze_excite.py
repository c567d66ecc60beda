"""Squeeze-excite's native passes: the global average pool of an image's codes and the gate's product
(``x * gate``, one code per image and channel), each one pass over the image (native.c), with the torch
kernels' codes bit for bit. The EfficientNet-like model ran 14.0 against 16.3 ms with these and the native
quantize (docs/benchmarks.md); each has a ``*_plan`` twin a program calls (passes/plan_program_calls.py)."""

from __future__ import annotations

from typing import Callable, Optional

import torch

from lucid_fx.kernels import program_ops
from lucid_fx.kernels.native import _CODES, bind
from lucid_fx.kernels.native_step import BUFFER, IN, native_step, returns_step

__all__ = ["is_gate", "gate_mul_codes", "gate_mul_plan", "global_avg_pool_codes", "global_avg_pool_plan"]


def _layout(q: torch.Tensor, dtype: torch.dtype) -> Optional[int]:
    """1: dense channels-last 4-d ``dtype`` codes on the CPU, 0: contiguous ones, None: others (torch's)."""
    if q.dtype != dtype or q.dim() != 4 or not q.is_cpu:
        return None
    if q.is_contiguous(memory_format=torch.channels_last):
        return 1
    return 0 if q.is_contiguous() else None


def is_gate(qa: torch.Tensor, qg: torch.Tensor) -> bool:
    """Whether ``qg`` holds one code per image and channel of 4-d ``qa`` (squeeze-excite's ``x * gate``)."""
    return qa.dim() == 4 and qg.dim() == 4 and tuple(qg.shape) == (qa.shape[0], qa.shape[1], 1, 1)


@returns_step("qa", "qg")
def gate_mul_codes(qa, a_zp: int, qg, g_zp: int, mult: float, zp: int, low: int, high: int, dtype,
                   plan: Optional[Callable] = None):
    """:func:`lucid_fx.kernels.program_ops.mul_codes` of 4-d codes ``qa`` (channels-last or
    contiguous) and a gate ``qg`` of shape ``(N, C, 1, 1)``, in one pass: its codes, bit for bit, in
    ``qa``'s layout. ``plan``: :func:`gate_mul_plan`'s."""
    if plan is None and qg.is_cpu:
        qg = qg.contiguous()
        plan = gate_mul_plan(qa, a_zp, qg, g_zp, mult, zp, low, high, dtype)
    out = None if plan is None else plan(qa, qg)
    return program_ops.mul_codes(qa, a_zp, qg, g_zp, mult, zp, low, high, dtype) if out is None else out


def gate_mul_plan(qa, a_zp: int, qg, g_zp: int, mult: float, zp: int, low: int, high: int, dtype) -> Optional[Callable]:
    """:func:`gate_mul_codes`' native call for operands laid out as ``qa`` and ``qg``, checked once:
    ``step(qa, qg)``, or None for tensors of other strides. None where the native kernel does not take them."""
    layout = _layout(qa, dtype)
    if layout is None or not is_gate(qa, qg) or qg.dtype != dtype or not qg.is_contiguous():
        return None
    n, c, h, w = qa.shape
    call = bind("gate_mul", dtype, n, h * w, c, layout, a_zp, g_zp, mult, zp, low, high)
    if call is None:
        return None
    return native_step(call, [(qa.shape, qa.stride(), dtype), (qg.shape, qg.stride(), dtype)], [(qa.shape, qa.stride(), dtype)],
                       [(IN, 0), (IN, 1), (BUFFER, 0)])


@returns_step("q")
def global_avg_pool_codes(q: torch.Tensor, scale: float, zp: int, out_scale: float, out_zp: int,
                          plan: Optional[Callable] = None) -> torch.Tensor:
    """:func:`lucid_fx.kernels.program_ops.global_avg_pool_codes` of 4-d codes in one pass (an int32
    sum per image and channel, then one requantization): its codes, bit for bit. ``plan``:
    :func:`global_avg_pool_plan`'s."""
    if plan is None:
        plan = global_avg_pool_plan(q, scale, zp, out_scale, out_zp)
    out = None if plan is None else plan(q)
    return program_ops.global_avg_pool_codes(q, scale, zp, out_scale, out_zp) if out is None else out


def global_avg_pool_plan(q: torch.Tensor, scale: float, zp: int, out_scale: float, out_zp: int) -> Optional[Callable]:
    """:func:`global_avg_pool_codes`' native call for codes laid out as ``q``, checked once: ``step(q)``, or None
    for codes of other strides. None where the native kernel does not take them."""
    dtype, layout = q.dtype, _layout(q, q.dtype)
    if layout is None or dtype not in _CODES:
        return None
    n, c, h, w = q.shape
    if h * w * 255 >= 2 ** 24:  # the sums must be exact in float32
        return None
    low, high = (0, 255) if dtype == torch.uint8 else (-128, 127)
    call = bind("global_avg_pool", dtype, n, h * w, c, layout, zp * h * w, scale / (out_scale * h * w), out_zp, low, high)
    if call is None:
        return None
    return native_step(call, [(q.shape, q.stride(), dtype)], [((n, c, 1, 1), (c, 1, 1, 1), dtype), ((c,), (1,), torch.int32)],
                       [(IN, 0), (BUFFER, 0), (BUFFER, 1)])
