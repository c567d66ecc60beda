"""Fused CUDA kernels in Triton: an int8 GEMM's whole epilogue, and the float-to-int8 boundary, one launch each.

On a GPU a converted model of small layers is bound by launches (docs/benchmarks.md: each int8
linear or convolution took about 18 kernels through torch ops, fp32's one or two). Here the steps
after ``torch._int_mm`` (the zero-point correction by weight row sums, the rescale by input and
weight scales, bias, a residual's dequantized codes, the post-op, requantization) are one kernel,
:func:`gemm_epilogue`, and quantization with its NaN/±inf check one more, :func:`quantize`
(a flag the kernel clears where it meets one, asserted with ``torch._assert_async``: no host sync).

Each computes what the torch ops compute (:func:`lucid_fx.kernels.reference.finish`, and
``quantize_per_tensor``), step for step in float32, rounding half to even; only the compiler's
fused multiply-adds may move a value at a rounding tie by one code. Triton ships with torch's CUDA
builds; without it (or with :data:`FUSED` False) the CUDA kernels run as torch ops. The kernels
also run on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``), which is how the tests check
them on machines without a GPU.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from typing import Optional, Tuple

import torch

from lucid_fx.kernels import checks
from lucid_fx.kernels.codes import POST_OPS, f32, f32_reciprocal

__all__ = ["FUSED", "available", "gemm_epilogue", "quantize"]

#: Whether the CUDA kernels use the fused Triton kernels where Triton is installed (False: torch ops).
FUSED = True
_POST = {name: i for i, name in enumerate(POST_OPS)}  # the post-op as a compile-time number
_BLOCK_M, _BLOCK_N, _BLOCK = 32, 64, 1024


@functools.lru_cache(maxsize=None)
def _triton():
    if importlib.util.find_spec("triton") is None:
        return None
    from lucid_fx.kernels import triton_kernels
    return importlib.reload(triton_kernels)  # decorated anew: Triton reads TRITON_INTERPRET then


def available(t: torch.Tensor) -> bool:
    """Whether the fused kernels serve ``t``'s device: CUDA (or Triton's interpreter on the CPU) with Triton."""
    if not FUSED or _triton() is None:
        return False
    return t.device.type == "cuda" or (t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def gemm_epilogue(
    acc: torch.Tensor, correction: int, row_sums: torch.Tensor, x_scale: float, w_scale: torch.Tensor,
    bias: Optional[torch.Tensor], post_op: str, out_scale: float, out_zp: int, dtype: torch.dtype,
    other: Optional[Tuple[torch.Tensor, float, int]] = None,
) -> torch.Tensor:
    """``finish((acc + correction * row_sums) * x_scale * w_scale + bias [+ dequantized other], post_op, ...)``
    for int32 ``acc`` (M, N) of any strides, as a contiguous (M, N) tensor of ``dtype`` (float32: no requantization).

    ``other`` is ``(codes, scale, zero_point)`` with codes (M, N) of any strides: a residual added before the post-op."""
    epilogue = _triton().epilogue
    m, n = acc.shape
    w_scale = w_scale.to(acc.device, torch.float32)
    bias = bias.to(acc.device, torch.float32) if bias is not None else None
    out = torch.empty((m, n), dtype=dtype, device=acc.device)
    quant = dtype != torch.float32
    info = torch.iinfo(dtype) if quant else None
    o_codes, o_scale, o_zp = other if other is not None else (acc, 1.0, 0)
    grid = (-(-m // _BLOCK_M), -(-n // _BLOCK_N))
    epilogue[grid](
        acc, acc.stride(0), acc.stride(1), row_sums, correction, f32(x_scale), w_scale,
        bias if bias is not None else w_scale, o_codes, o_codes.stride(0), o_codes.stride(1), f32(o_scale), o_zp,
        out, m, n, f32_reciprocal(out_scale) if quant else 1.0, out_zp, info.min if quant else 0,
        info.max if quant else 0, HAS_BIAS=bias is not None, HAS_OTHER=other is not None, POST=_POST[post_op],
        QUANT=quant, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N,
    )
    return out


def quantize(x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int,
             dtype: torch.dtype) -> torch.Tensor:
    """``quantize_per_tensor`` in one pass that also refuses NaN and ±inf (asynchronously: on CUDA
    the error surfaces as a device-side assert, as :func:`lucid_fx.kernels.checks.require_finite`'s)."""
    quantize_codes = _triton().quantize_codes
    dense = x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))
    x = x if dense else x.contiguous()
    out = torch.empty_like(x, dtype=dtype)  # the same strides: both are walked in memory order
    ok = torch.ones((), dtype=torch.int32, device=x.device)
    if x.numel():
        quantize_codes[(-(-x.numel() // _BLOCK),)](x, out, ok, x.numel(), f32_reciprocal(scale), zero_point,
                                                    quant_min, quant_max, BLOCK=_BLOCK)
    checks.assert_finite_flag("quantize_per_tensor", x, ok)
    return out
