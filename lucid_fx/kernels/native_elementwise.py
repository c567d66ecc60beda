"""Native one-pass kernels for elementwise steps of programs: quantize to channels-last, dequantize,
and the product and sum of two code tensors of any strides and broadcast (llama's rotary
``q * cos + rotate_half(q) * sin``, a layer scale, a norm's weight). Each gives the torch kernels' values bit for bit, and falls back to them where the native
kernels are not loaded (:mod:`lucid_fx.kernels.native`) or the operands are not what the program
was built for.

>>> a = torch.tensor([[130, 126]], dtype=torch.uint8)  # values 2 and -2 (zero point 128)
>>> b = torch.tensor([[1], [3]], dtype=torch.uint8)  # values 1 and 3 (zero point 0)
>>> plan = broadcast_plan(a, b, torch.empty(2, 2, dtype=torch.uint8))
>>> mul_codes(a, 128, b, 0, 1.0, 100, 0, 255, torch.uint8, plan)  # codes of a * b on zero point 100
tensor([[102,  98],
        [106,  94]], dtype=torch.uint8)
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch

from lucid_fx.kernels import channel_lut as _channel_lut
from lucid_fx.kernels import finite, native, program_ops
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.codes import f32
from lucid_fx.kernels.native import _function
from lucid_fx.kernels.native_step import BUFFER, IN, native_step, returns_step

__all__ = ["Broadcast", "broadcast_plan", "mul_codes", "add_codes", "fused_add", "quantize_channels_last",
           "dequantize_codes", "channel_lut", "channel_lut_cat", "quantize_step", "quantize_channels_last_plan", "MAX_DIMS"]

MAX_DIMS = 6


@dataclass(frozen=True)
class Broadcast:
    """How two operands broadcast to an output, decided when a program is built: the strides the
    operands must have at run time, the output's shape and strides, and the C loop's geometry
    (shape, then a's, b's and out's strides in elements, ``MAX_DIMS`` each, outermost first)."""

    a_stride: Tuple[int, ...]
    b_stride: Tuple[int, ...]
    shape: Tuple[int, ...]
    out_stride: Tuple[int, ...]
    geometry: torch.Tensor  # int64 (4 * MAX_DIMS,)


def _broadcast_strides(t: torch.Tensor, shape: Tuple[int, ...]) -> list:
    lead = len(shape) - t.dim()
    return [0] * lead + [0 if size == 1 else stride for size, stride in zip(t.shape, t.stride())]


def broadcast_plan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Optional[Broadcast]:
    """The plan for ``out = a * b`` with these (fake or real) values' shapes and strides; None past
    ``MAX_DIMS`` dims or where ``a`` and ``b`` do not broadcast to ``out``'s shape."""
    shape = tuple(out.shape)
    if len(shape) > MAX_DIMS or tuple(torch.broadcast_shapes(a.shape, b.shape)) != shape:
        return None
    sa, sb, so = _broadcast_strides(a, shape), _broadcast_strides(b, shape), list(out.stride())
    order = sorted(range(len(shape)), key=lambda d: -so[d])  # the output's memory order: inner loop last
    pad = MAX_DIMS - len(shape)
    rows = [[1] * pad + [shape[d] for d in order]] + [[0] * pad + [s[d] for d in order] for s in (sa, sb, so)]
    geometry = torch.tensor([v for row in rows for v in row], dtype=torch.int64)
    return Broadcast(tuple(a.stride()), tuple(b.stride()), shape, tuple(out.stride()), geometry)


def _planned(kernel: str, qa, qb, dtype, plan: Broadcast, numbers: tuple, fallback):
    """``kernel``'s one pass over ``qa`` and ``qb`` into codes laid out as ``plan`` says, with the C
    function's trailing ``numbers``; ``fallback()`` (the torch kernels) where the native kernels are
    not loaded or the operands are not what the plan was built for."""
    fn = _function(kernel, dtype)
    if (fn is None or qa.dtype != dtype or qb.dtype != dtype or qa.stride() != plan.a_stride
            or qb.stride() != plan.b_stride or not qa.is_cpu or not qb.is_cpu):
        return fallback()
    out = torch.empty_strided(plan.shape, plan.out_stride, dtype=dtype)
    fn(qa.data_ptr(), qb.data_ptr(), out.data_ptr(), plan.geometry.data_ptr(), *numbers)
    return out


def mul_codes(qa, a_zp: int, qb, b_zp: int, mult: float, zp: int, low: int, high: int, dtype, plan: Broadcast):
    """:func:`lucid_fx.kernels.program_ops.mul_codes` in one pass, for operands with the strides of
    ``plan``; its values bit for bit, in the layout the program recorded."""
    return _planned("mul_strided", qa, qb, dtype, plan, (a_zp, b_zp, mult, zp, low, high),
                    lambda: program_ops.mul_codes(qa, a_zp, qb, b_zp, mult, zp, low, high, dtype))


def fused_add() -> bool:
    """Whether this process's torch adds ``x + alpha * y`` with one rounding (a fused multiply-add), as
    its AVX2 and AVX-512 kernels do, measured here for every length, stride and broadcast; its
    DEFAULT kernels round twice. :func:`add_codes` has the fused arithmetic, so it runs only then."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def add_codes(qa, a_zp: int, a_mult: float, qb, b_zp: int, b_mult: float, zp: int, low: int, high: int, dtype,
              plan: Broadcast):
    """:func:`lucid_fx.kernels.program_ops.add_codes` in one pass, for operands with the strides of
    ``plan`` where :func:`fused_add`; its values bit for bit, in the layout the program recorded."""
    return _planned("add_strided", qa, qb, dtype, plan, (a_zp, a_mult, b_zp, b_mult, zp, low, high),
                    lambda: program_ops.add_codes(qa, a_zp, a_mult, qb, b_zp, b_mult, zp, low, high, dtype))


@returns_step("x")
def quantize_channels_last(x: torch.Tensor, inv_scale: float, zp: int, qmin: int, qmax: int,
                           dtype: torch.dtype, plan: Optional[Callable] = None) -> torch.Tensor:
    """:func:`lucid_fx.kernels.native.quantize_codes` of a contiguous 4-d float32 ``x``, written
    channels-last in the same pass (what a convolution reads): its codes, bit for bit, without the
    copy to channels-last after it. Other inputs take that quantize and the copy. ``plan``:
    :func:`quantize_channels_last_plan`'s."""
    out = None if plan is None else plan(x)
    if out is not None:
        return out
    fn = _function("quantize_cl", dtype)
    if fn is None or not _takes_channels_last(x):
        return native.quantize_codes(x, inv_scale, zp, qmin, qmax, dtype).contiguous(memory_format=torch.channels_last)
    n, c, h, w = x.shape
    out = torch.empty((n, c, h, w), dtype=dtype, memory_format=torch.channels_last)
    if fn(x.data_ptr(), out.data_ptr(), n, c, h * w, inv_scale, zp, qmin, qmax, native.check_finite):
        finite.refuse_nonfinite("quantize_per_tensor", x)  # raises unless a finite x overflowed float32
    return out


def dequantize_codes(q: torch.Tensor, scale: float, zp: int) -> torch.Tensor:
    """``lucid_fx::dequantize_per_tensor`` (float32 ``(q - zp) * scale``) of dense 8-bit codes in one
    pass, in ``q``'s layout: the reference kernel's values bit for bit."""
    fn = _function("dequantize", q.dtype)
    if fn is None or not q.is_cpu:
        return ref.dequantize_per_tensor(q, scale, zp)
    out = torch.empty_like(q, dtype=torch.float32)
    if out.stride() != q.stride():  # not dense: the reference kernel's layout
        return ref.dequantize_per_tensor(q, scale, zp)
    fn(q.data_ptr(), out.data_ptr(), q.numel(), zp, f32(scale))
    return out


def channel_lut(q: torch.Tensor, tables: torch.Tensor, dim: int) -> torch.Tensor:
    """``lucid_fx::channel_lut`` on the CPU: one pass over contiguous codes, or channels-last 4-d codes
    with ``dim`` 1; the reference kernel's values, in ``q``'s layout (anything else takes it)."""
    fn = _function("channel_lut", tables.dtype)
    dim = dim % max(q.dim(), 1)
    if fn is None or not q.is_cpu or q.dtype not in (torch.uint8, torch.int8) or tables.dim() != 2 \
            or tables.shape != (q.shape[dim], 256) or not tables.is_cpu:
        return _channel_lut.channel_lut(q, tables, dim)
    c = q.shape[dim]
    if q.is_contiguous():
        outer, inner = q.shape[:dim].numel(), q.shape[dim + 1:].numel()
    elif q.dim() == 4 and dim == 1 and q.is_contiguous(memory_format=torch.channels_last):
        outer, inner = q.numel() // max(c, 1), 1
    else:
        return _channel_lut.channel_lut(q, tables, dim)
    out, tables = torch.empty_like(q, dtype=tables.dtype), tables.contiguous()  # held while the C loop reads it
    fn(q.data_ptr(), tables.data_ptr(), out.data_ptr(), outer, c, inner, 128 if q.dtype == torch.int8 else 0)
    return out


def channel_lut_cat(parts: Sequence[torch.Tensor], tables: torch.Tensor) -> torch.Tensor:
    """``channel_lut(torch.cat(parts, 1), tables, 1)`` of channels-last 4-d codes in one pass, without
    the cat (DenseNet's cat -> batch norm -> relu): the same values, channels-last. Parts of other
    layouts, shapes or dtypes take the cat and :func:`channel_lut`."""
    fn, first = _function("channel_lut_cat", tables.dtype), parts[0]
    if fn is None or tables.dim() != 2 or not tables.is_cpu or first.dtype not in (torch.uint8, torch.int8) \
            or not all(p.dim() == 4 and p.dtype == first.dtype and p.is_cpu
                       and p.shape[0] == first.shape[0] and p.shape[2:] == first.shape[2:]
                       and p.is_contiguous(memory_format=torch.channels_last) for p in parts) \
            or tables.shape != (sum(p.shape[1] for p in parts), 256):
        return channel_lut(torch.cat(list(parts), 1), tables, 1)
    n, c, (h, w) = first.shape[0], tables.shape[0], first.shape[2:]
    out, tables = torch.empty((n, c, h, w), dtype=tables.dtype, memory_format=torch.channels_last), tables.contiguous()
    sources = (ctypes.c_void_p * len(parts))(*[p.data_ptr() for p in parts])
    widths = (ctypes.c_int64 * len(parts))(*[p.shape[1] for p in parts])
    fn(ctypes.addressof(sources), ctypes.addressof(widths), len(parts), tables.data_ptr(), out.data_ptr(), n * h * w, c,
       128 if first.dtype == torch.int8 else 0)
    return out


def _takes_channels_last(x: torch.Tensor) -> bool:
    return x.dim() == 4 and x.dtype == torch.float32 and x.is_contiguous() and x.is_cpu


def quantize_channels_last_plan(x: torch.Tensor, inv_scale: float, zp: int, qmin: int, qmax: int,
                                dtype: torch.dtype) -> Optional[Callable]:
    """:func:`quantize_channels_last`'s call as a native step for a contiguous 4-d float32 ``x`` of this shape, or None
    for other inputs and a non-finite value (its checked path raises, naming the node)."""
    if dtype not in native._CODES or not _takes_channels_last(x):
        return None
    n, c, h, w = x.shape
    call = native.bind("quantize_cl", dtype, n, c, h * w, inv_scale, zp, qmin, qmax, native.check_finite)
    if call is None:
        return None
    out_strides = torch.empty(x.shape, dtype=dtype, device="meta", memory_format=torch.channels_last).stride()
    return native_step(call, [(x.shape, x.stride(), torch.float32)], [(x.shape, out_strides, dtype)], [(IN, 0), (BUFFER, 0)])


def quantize_step(x: torch.Tensor, inv_scale: float, zp: int, qmin: int, qmax: int,
                  dtype: torch.dtype) -> Optional[Callable]:
    """A program's plan of :func:`lucid_fx.kernels.native.quantize_codes` (its ``quantize_plan``'s call as a native
    step): ``step(x)``, codes in ``x``'s layout, or None for float32 ``x`` of other strides and for a non-finite
    value (the kernel's count), so that ``quantize_codes``' checked path raises, naming the node."""
    call = native.quantize_call(x, inv_scale, zp, qmin, qmax, dtype)
    if call is None:
        return None
    return native_step(call, [(x.shape, x.stride(), torch.float32)], [(x.shape, x.stride(), dtype)], [(IN, 0), (BUFFER, 0)])
