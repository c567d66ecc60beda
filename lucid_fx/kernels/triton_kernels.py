"""The Triton kernels of :mod:`lucid_fx.kernels.cuda_fused` (imported only where Triton is installed).

``POST`` numbers the post-ops in :data:`lucid_fx.kernels.codes.POST_OPS` order: none, relu, hardswish,
silu, gelu, gelu_tanh, tanh, sigmoid."""

import triton
import triton.language as tl

__all__ = ["epilogue", "quantize_codes"]


@triton.jit
def _round_clamp(v, zp, qmin, qmax):
    # clamp(round_half_even(v) + zp, qmin, qmax); v is first bounded a code beyond the grid (which changes
    # no result) so that floor(v + 0.5) is exact in float32
    v = tl.minimum(tl.maximum(v, qmin - zp - 1.0), qmax - zp + 1.0)
    r = tl.floor(v + 0.5)
    r = tl.where(((r - v) == 0.5) & ((r - 2.0 * tl.floor(r * 0.5)) != 0.0), r - 1.0, r)
    return tl.minimum(tl.maximum(r + zp, qmin), qmax)


@triton.jit
def _post_op(y, POST: tl.constexpr):
    # POST_OPS order: none, relu, hardswish, silu, gelu, gelu_tanh, tanh, sigmoid
    if POST == 1:
        y = tl.maximum(y, 0.0)
    elif POST == 2:
        y = y * tl.minimum(tl.maximum(y + 3.0, 0.0), 6.0) / 6.0
    elif POST == 3:
        y = y / (1.0 + tl.exp(-y))
    elif POST == 4:
        y = 0.5 * y * (1.0 + tl.erf(y * 0.7071067811865476))
    elif POST == 5:
        t = 0.7978845608028654 * (y + 0.044715 * y * y * y)
        y = 0.5 * y * (1.0 + (2.0 / (1.0 + tl.exp(-2.0 * t)) - 1.0))
    elif POST == 6:
        y = 2.0 / (1.0 + tl.exp(-2.0 * y)) - 1.0
    elif POST == 7:
        y = 1.0 / (1.0 + tl.exp(-y))
    return y


@triton.jit
def epilogue(acc_ptr, stride_am, stride_an, rows_ptr, correction, x_scale, ws_ptr, bias_ptr, other_ptr,
             stride_om, stride_on, other_scale, other_zp, out_ptr, M, N, inv_out, out_zp, qmin, qmax,
             HAS_BIAS: tl.constexpr, HAS_OTHER: tl.constexpr, POST: tl.constexpr, QUANT: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    cols, mask = rn < N, (rm < M) & (rn < N)
    acc = tl.load(acc_ptr + rm * stride_am + rn * stride_an, mask=mask, other=0)
    acc = acc + correction * tl.load(rows_ptr + rn, mask=cols, other=0)
    y = acc.to(tl.float32) * (x_scale * tl.load(ws_ptr + rn, mask=cols, other=0.0))
    if HAS_BIAS:
        y = y + tl.load(bias_ptr + rn, mask=cols, other=0.0)
    if HAS_OTHER:
        other = tl.load(other_ptr + rm * stride_om + rn * stride_on, mask=mask, other=0).to(tl.float32)
        y = y + (other - other_zp) * other_scale
    y = _post_op(y, POST)
    if QUANT:
        y = _round_clamp(y * inv_out, out_zp, qmin, qmax)
    tl.store(out_ptr + rm * N + rn, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_codes(x_ptr, out_ptr, ok_ptr, numel, inv_scale, zp, qmin, qmax, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    tl.atomic_min(ok_ptr + offs * 0, 0, mask=mask & bad)
    tl.store(out_ptr + offs, _round_clamp(x * inv_scale, zp, qmin, qmax).to(out_ptr.dtype.element_ty), mask=mask)
