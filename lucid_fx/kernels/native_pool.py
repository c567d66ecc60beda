"""Max and average pooling of channels-last 8-bit codes in one native pass (native_pool.c), for programs.

Without it a program's max pool is :func:`~lucid_fx.kernels.program_ops.max_pool_taps` (a padded
copy and a maximum per tap over strided views) and its average pool is the reference kernel
(dequantize, float pool, quantize). :func:`pool_plan` decides at program build, for the input
signature the program was recorded on (shape, layout, output strides), whether the native pass
takes a pool; :func:`pool_codes` runs it, or that torch path where the native kernels are not
loaded or the codes do not have the recorded strides.

- **max:** the window's largest code: the torch path's codes exactly.
- **average:** an exact int32 sum of the window's codes, then one requantization with torch's
  divisor: the exact average's code except at exact ties, one code from the reference's float
  average at most.

Measured on DenseNet-like's pools (AVX512-VNNI EPYC, 1 thread): docs/benchmarks.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from lucid_fx.kernels import program_ops
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.native import _function, bind
from lucid_fx.kernels.native_step import BUFFER, IN, native_step, returns_step

__all__ = ["Pool", "pool_plan", "pool_codes", "pool_step", "MAX_TAPS"]

MAX_TAPS = 4096  # windows up to this many taps: their int32 sums and zp * taps stay exact in float32
_MODES = {"max": 0, "avg_with_pad": 1, "avg": 2}


@dataclass(frozen=True)
class Pool:
    """One pool on codes of one signature: what native_pool.c reads (``geometry``, ``ratio``), the
    strides it was decided for, and the torch path's arguments."""

    in_shape: Tuple[int, ...]
    in_stride: Tuple[int, ...]
    out_shape: Tuple[int, ...]
    out_stride: Tuple[int, ...]
    geometry: torch.Tensor  # int64 (18,): native_pool.c's g
    ratio: float  # scale / out_scale (average), unused by max
    kind: str  # "max", "avg_with_pad" or "avg"
    torch_args: tuple  # max_pool_taps' (kernel, stride, padding), or reference.avg_pool2d's after q


def pool_plan(q, out, kind: str, kernel: List[int], stride: List[int], padding: List[int],
              qparams: Tuple[float, int, float, int] = (1.0, 0, 1.0, 0)) -> Optional[Pool]:
    """The plan of one pool of 4-d codes ``q`` (fake or real) into ``out`` of the recorded shape and
    strides, with ``qparams`` = (scale, zp, out_scale, out_zp) for an average; None where the native
    pass does not take it: other dtypes, input or output not dense channels-last (contiguous planes
    keep the torch path, measured faster), padding past half the window (torch refuses that), windows
    over :data:`MAX_TAPS`."""
    (kh, kw), (sh, sw), (ph, pw) = kernel, stride, padding
    channels_last = q.dim() == out.dim() == 4 and all(t.is_contiguous(memory_format=torch.channels_last) for t in (q, out))
    if (not channels_last or q.dtype not in (torch.uint8, torch.int8) or out.dtype != q.dtype
            or 2 * ph > kh or 2 * pw > kw or kh * kw > MAX_TAPS or min(sh, sw, kh, kw) < 1):
        return None
    scale, zp, out_scale, out_zp = qparams
    low, high = (0, 255) if q.dtype == torch.uint8 else (-128, 127)
    n, c, h, w = q.shape
    geometry = [n, c, h, w, out.shape[2], out.shape[3], 1, kh, kw, sh, sw, ph, pw, _MODES[kind], zp, out_zp, low, high]
    if kind == "max":
        torch_args = (list(kernel), list(stride), list(padding))
    else:
        torch_args = (scale, zp, list(kernel), list(stride), list(padding), False, kind == "avg_with_pad", out_scale, out_zp)
    return Pool(tuple(q.shape), tuple(q.stride()), tuple(out.shape), tuple(out.stride()),
                torch.tensor(geometry, dtype=torch.int64), float(scale) / float(out_scale), kind, torch_args)


@returns_step("q", step="step")
def pool_codes(q: torch.Tensor, pool: Pool, step: Optional[Callable] = None) -> torch.Tensor:
    """The pool ``pool`` of ``q``'s codes in the recorded output strides: ``step`` (:func:`pool_step`'s) where it takes
    ``q``, else native_pool.c where it is loaded and ``q`` has the recorded shape and strides, else the torch path (the
    same codes for max, the reference's for average)."""
    out = None if step is None else step(q)
    if out is not None:
        return out
    fn = _function("pool", q.dtype)
    if fn is not None and tuple(q.shape) == pool.in_shape and q.stride() == pool.in_stride and q.is_cpu:
        out = torch.empty_strided(pool.out_shape, pool.out_stride, dtype=q.dtype)
        if fn(q.data_ptr(), out.data_ptr(), pool.geometry.data_ptr(), pool.ratio) == 0:
            return out
    if pool.kind == "max":
        return program_ops.max_pool_taps(q, *pool.torch_args)
    return ref.avg_pool2d(q, *pool.torch_args)


def pool_step(pool: Pool, dtype: torch.dtype) -> Optional[Callable]:
    """A program's planned :func:`pool_codes` of ``dtype`` codes (a native step: checked, allocated and called in C++):
    ``step(q)``, or None for codes of other strides and where a thread had no scratch. None without the native
    kernels."""
    call = bind("pool", dtype, pool.ratio)
    if call is None:
        return None
    return native_step(call, [(pool.in_shape, pool.in_stride, dtype)], [(pool.out_shape, pool.out_stride, dtype)],
                       [(IN, 0), (BUFFER, 0), pool.geometry.data_ptr()], keep=pool)
