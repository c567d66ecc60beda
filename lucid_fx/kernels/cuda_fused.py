"""Fused CUDA kernels in Triton: each step around an int8 GEMM, and each elementwise int8 op, one launch.

On a GPU a converted model of small layers is bound by launches (docs/benchmarks.md: an int8 linear
took about 18 kernels as torch ops, fp32's one or two). Here a GEMM's int8 operand (im2col or rows,
shifted into int8 and padded for ``torch._int_mm``: :func:`gemm_operand`) is one kernel, the steps after
the GEMM (the zero-point correction by weight row sums, the rescale by input and weight scales, bias, a
residual's dequantized codes, the post-op, requantization: :func:`gemm_epilogue`) one more, so a linear
is three launches. Quantization with its NaN/±inf check (a flag the kernel clears where it meets one,
asserted with ``torch._assert_async``: no host sync), dequantization, table lookups, elementwise add and
mul, and global average pooling are one kernel each.

Each computes what the torch ops compute (:func:`lucid_fx.kernels.reference.finish`, and
``quantize_per_tensor``), step for step in float32, rounding half to even; only the compiler's fused
multiply-adds may move a value at a rounding tie by one code (and the global average sums the codes
exactly, where torch's mean sums rounded floats). Triton ships with torch's CUDA builds; without it (or
with :data:`FUSED` False, or a kernel named in :data:`OFF`) the CUDA kernels run as torch ops. The
kernels also run on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests
check them on machines without a GPU. The kernels themselves are in :mod:`lucid_fx.kernels.triton_kernels`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional, Set, Tuple

import torch

from lucid_fx.kernels import finite
from lucid_fx.kernels.codes import POST_OPS, f32, f32_reciprocal

__all__ = [
    "FUSED", "KERNELS", "OFF", "available", "gemm_epilogue", "gemm_operand", "quantize", "dequantize", "lut", "binary",
    "global_average",
]

#: Whether the CUDA kernels use the fused Triton kernels where Triton is installed (False: torch ops).
FUSED = True
#: The fused kernels, by the name :func:`available` takes; those in :data:`OFF` run as torch ops (a benchmark
#: turns one off to measure it: ``benchmarks/cuda_inference.py --off operand``).
KERNELS = ("operand", "epilogue", "quantize", "dequantize", "lut", "binary", "global_average")
OFF: Set[str] = set()
_POST = {name: i for i, name in enumerate(POST_OPS)}  # the post-op as a compile-time number
_BLOCK_M, _BLOCK_N, _BLOCK = 32, 64, 1024


@functools.lru_cache(maxsize=None)
def _triton():
    if importlib.util.find_spec("triton") is None:
        return None
    from lucid_fx.kernels import triton_kernels
    return importlib.reload(triton_kernels)  # decorated anew: Triton reads TRITON_INTERPRET then


def available(t: torch.Tensor, kernel: str) -> bool:
    """Whether the fused ``kernel`` (one of :data:`KERNELS`) serves ``t``'s device: CUDA (or Triton's
    interpreter on the CPU) with Triton, and neither :data:`FUSED` off nor ``kernel`` in :data:`OFF`."""
    on_device = t.device.type == "cuda" or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return FUSED and on_device and kernel not in OFF and _triton() is not None


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` can be walked in memory order (``empty_like`` then has its strides)."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last))


def _blocks(numel: int) -> Tuple[int]:
    return (-(-numel // _BLOCK),)


def gemm_epilogue(
    acc: torch.Tensor, correction: int, row_sums: Optional[torch.Tensor], x_scale: float, w_scale: torch.Tensor,
    bias: Optional[torch.Tensor], post_op: str, out_scale: float, out_zp: int, dtype: torch.dtype,
    other: Optional[Tuple[torch.Tensor, float, int]] = None, out: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``finish((acc + correction * row_sums) * x_scale * w_scale + bias [+ dequantized other], post_op, ...)``
    for ``acc`` (M, N) of any strides (int32 sums, or float32 ones with ``row_sums`` None), into ``out``
    (M, N) of ``dtype`` and any strides, a new contiguous tensor if None (float32: no requantization).

    ``other`` is ``(codes, scale, zero_point)`` with codes (M, N) of any strides: a residual added before the
    post-op."""
    m, n = acc.shape
    w_scale = w_scale.to(acc.device, torch.float32)
    bias = bias.to(acc.device, torch.float32) if bias is not None else None
    out = torch.empty((m, n), dtype=dtype, device=acc.device) if out is None else out
    quant = dtype != torch.float32
    info = torch.iinfo(dtype) if quant else None
    o_codes, o_scale, o_zp = other if other is not None else (acc, 1.0, 0)
    _triton().epilogue[(-(-m // _BLOCK_M), -(-n // _BLOCK_N))](
        acc, acc.stride(0), acc.stride(1), row_sums if row_sums is not None else w_scale, correction, f32(x_scale),
        w_scale, bias if bias is not None else w_scale, o_codes, o_codes.stride(0), o_codes.stride(1), f32(o_scale),
        o_zp, out, out.stride(0), out.stride(1), m, n, f32_reciprocal(out_scale) if quant else 1.0, out_zp,
        info.min if quant else 0, info.max if quant else 0, HAS_ROWS=row_sums is not None, HAS_BIAS=bias is not None,
        HAS_OTHER=other is not None, POST=_POST[post_op], QUANT=quant, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
    )
    return out


def quantize(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int,
             dtype: torch.dtype) -> torch.Tensor:
    """``quantize_per_tensor`` in one pass that also refuses NaN and ±inf (asynchronously: on CUDA
    the error surfaces as a device-side assert, as :func:`lucid_fx.kernels.finite.require_finite`'s)."""
    x = x if _dense(x) else x.contiguous()
    out = torch.empty_like(x, dtype=dtype)  # the same strides: both are walked in memory order
    ok = torch.ones((), dtype=torch.int32, device=x.device)
    if x.numel():
        _triton().quantize_codes[_blocks(x.numel())](x, out, ok, x.numel(), f32_reciprocal(scale), zero_point,
                                                     quant_min, quant_max, BLOCK=_BLOCK)
    finite.assert_finite_flag("quantize_per_tensor", x, ok)
    return out


def dequantize(q: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """Float32 ``(q - zero_point) * scale`` of 8-bit codes in one pass, in ``q``'s layout."""
    q = q if _dense(q) else q.contiguous()
    out = torch.empty_like(q, dtype=torch.float32)
    if q.numel():
        _triton().dequantize_codes[_blocks(q.numel())](q, out, q.numel(), f32(scale), zero_point, BLOCK=_BLOCK)
    return out


def lut(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[code]`` for each code (int8 codes from -128), in ``q``'s layout."""
    q = q if _dense(q) else q.contiguous()
    out = torch.empty_like(q, dtype=table.dtype)
    if q.numel():
        _triton().lookup[_blocks(q.numel())](q, table.to(q.device), out, q.numel(), SIGNED=q.dtype == torch.int8,
                                             BLOCK=_BLOCK)
    return out


@functools.lru_cache(maxsize=1024)
def _binary_layout(a: tuple, b: tuple) -> Tuple[tuple, tuple]:
    """The shape and strides torch gives ``a + b`` for ``(shape, strides)`` operands (the fake kernel's)."""
    meta = [torch.empty_strided(shape, strides, device="meta") for shape, strides in (a, b)]
    out = meta[0] + meta[1]
    return tuple(out.shape), out.stride()


def binary(mul: bool, qa: torch.Tensor, a_scale: float, a_zp: int, qb: torch.Tensor, b_scale: float, b_zp: int,
           out_scale: float, out_zp: int, post_op: str) -> Optional[torch.Tensor]:
    """``post_op(a + b)`` (``a * b`` where ``mul``) of per-tensor codes, broadcasting, in one pass; None for
    operands of more than 4 dims (the torch ops serve them)."""
    shape, strides = _binary_layout((tuple(qa.shape), qa.stride()), (tuple(qb.shape), qb.stride()))
    if len(shape) > 4:
        return None
    out = torch.empty_strided(shape, strides, dtype=qa.dtype, device=qa.device)
    order = sorted(range(len(shape)), key=lambda d: -strides[d])  # out's dims in memory order
    views = [t.expand(shape).permute(order) for t in (out, qa, qb)]
    if not views[0].is_contiguous():
        return None
    pad = 4 - len(shape)
    sizes = [1] * pad + list(views[0].shape)
    sa, sb = ([0] * pad + list(v.stride()) for v in views[1:])
    info = torch.iinfo(qa.dtype)
    if out.numel():
        _triton().binary[_blocks(out.numel())](
            qa, f32(a_scale), a_zp, *sa, qb, f32(b_scale), b_zp, *sb, out, out.numel(), sizes[1], sizes[2], sizes[3],
            f32_reciprocal(out_scale), out_zp, info.min, info.max, MUL=mul, POST=_POST[post_op], BLOCK=_BLOCK,
        )
    return out


def gemm_operand(q: torch.Tensor, zero_point: int, kernel=(1, 1), stride=(1, 1), padding=(0, 0), dilation=(1, 1),
                 pad: bool = True) -> Tuple[torch.Tensor, int, Tuple[int, int, int]]:
    """The int8 left operand of an int8 GEMM in one pass: for 4-d codes (N, C, H, W) of any strides a
    convolution's im2col rows (one per output pixel in (N, Ho, Wo) order, taps and channels with channels
    fastest, the zero point's code outside the image), for 2-d codes (M, K) the rows themselves; uint8 codes
    shifted into int8. ``pad``: zero rows and columns up to the shape CUDA's ``torch._int_mm`` takes (more than
    16 rows, columns a multiple of 8). Returns the operand, the zero-point correction (``int_mm``'s), and
    ``(n, ho, wo)``."""
    if q.dim() == 2:
        (n, c), (h, w), (sn, sc), (sh, sw) = q.shape, (1, 1), q.stride(), (0, 0)
    else:
        (n, c, h, w), (sn, sc, sh, sw) = q.shape, q.stride()
    (kh, kw), (st_h, st_w), (p_h, p_w), (d_h, d_w) = kernel, stride, padding, dilation
    ho, wo = (h + 2 * p_h - d_h * (kh - 1) - 1) // st_h + 1, (w + 2 * p_w - d_w * (kw - 1) - 1) // st_w + 1
    m, k = n * ho * wo, kh * kw * c
    mp, kp = (max(m, 17), -(-k // 8) * 8) if pad else (m, k)
    flip = q.dtype == torch.uint8
    cols = torch.empty((mp, kp), dtype=torch.int8, device=q.device)
    _triton().im2col[(-(-mp // _BLOCK_M), -(-kp // _BLOCK_N))](
        q, sn, sc, sh, sw, cols, m, k, mp, kp, c, h, w, ho, wo, st_h, st_w, p_h, p_w, d_h, d_w, kw,
        zero_point - 128 if flip else zero_point, FLIP=flip, BLOCK_M=_BLOCK_M, BLOCK_K=_BLOCK_N,
    )
    return cols, (128 - zero_point) if flip else -zero_point, (n, ho, wo)


def global_average(q: torch.Tensor, scale: float, zero_point: int, out_scale: float, out_zp: int) -> torch.Tensor:
    """Codes of the mean over H and W of 4-d codes (N, C, H, W) of any strides, as (N, C, 1, 1) contiguous:
    the codes summed exactly, then rescaled once (``adaptive_avg_pool2d`` to 1 x 1)."""
    n, c, h, w = q.shape
    out = torch.empty((n, c, 1, 1), dtype=q.dtype, device=q.device)
    info = torch.iinfo(q.dtype)
    block_c = 64
    _triton().global_average[(n, -(-c // block_c))](
        q, *q.stride(), out, c, h * w, w, f32(scale) / (h * w), zero_point * h * w, f32_reciprocal(out_scale), out_zp,
        info.min, info.max, BLOCK_C=block_c, BLOCK_HW=32,
    )
    return out
