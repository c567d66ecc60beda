"""The Triton kernels of :mod:`lucid_fx.kernels.cuda_fused` (imported only where Triton is installed).

``POST`` numbers the post-ops in :data:`lucid_fx.kernels.codes.POST_OPS` order: none, relu, hardswish,
silu, gelu, gelu_tanh, tanh, sigmoid."""

import triton
import triton.language as tl

__all__ = ["epilogue", "quantize_codes", "dequantize_codes", "lookup", "binary", "im2col", "global_average"]


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
             stride_om, stride_on, other_scale, other_zp, out_ptr, stride_ym, stride_yn, M, N, inv_out, out_zp,
             qmin, qmax, HAS_ROWS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_OTHER: tl.constexpr,
             POST: tl.constexpr, QUANT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """out[m, n] = finish((acc[m, n] + correction * rows[n]) * x_scale * ws[n] + bias[n] + deq(other[m, n]))."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N))[None, :]
    cols, mask = rn < N, (rm < M) & (rn < N)
    acc = tl.load(acc_ptr + rm * stride_am + rn * stride_an, mask=mask, other=0)
    if HAS_ROWS:
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
    tl.store(out_ptr + rm * stride_ym + rn * stride_yn, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def quantize_codes(x_ptr, out_ptr, ok_ptr, numel, inv_scale, zp, qmin, qmax, BLOCK: tl.constexpr):
    """Codes of float x (both walked in memory order); ok cleared where x holds NaN or +-inf."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    bad = (x != x) | (tl.abs(x) == float("inf"))
    tl.atomic_min(ok_ptr + offs * 0, 0, mask=mask & bad)
    tl.store(out_ptr + offs, _round_clamp(x * inv_scale, zp, qmin, qmax).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def dequantize_codes(q_ptr, out_ptr, numel, scale, zp, BLOCK: tl.constexpr):
    """Float32 (q - zp) * scale, in memory order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    q = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.float32)
    tl.store(out_ptr + offs, (q - zp) * scale, mask=mask)


@triton.jit
def lookup(q_ptr, table_ptr, out_ptr, numel, SIGNED: tl.constexpr, BLOCK: tl.constexpr):
    """table[code] (int8 codes index from -128), in memory order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    index = tl.load(q_ptr + offs, mask=mask, other=0).to(tl.int32)
    if SIGNED:
        index = index + 128
    tl.store(out_ptr + offs, tl.load(table_ptr + index, mask=mask, other=0), mask=mask)


@triton.jit
def binary(a_ptr, a_scale, a_zp, sa0, sa1, sa2, sa3, b_ptr, b_scale, b_zp, sb0, sb1, sb2, sb3, out_ptr, numel,
           size1, size2, size3, inv_out, out_zp, qmin, qmax, MUL: tl.constexpr, POST: tl.constexpr,
           BLOCK: tl.constexpr):
    """Codes of post(deq(a) + deq(b)) (or *) over 4-d broadcast views; out is contiguous in their dim order."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    i3 = offs % size3
    rest = offs // size3
    i2 = rest % size2
    rest = rest // size2
    i1 = rest % size1
    i0 = rest // size1
    a = tl.load(a_ptr + i0 * sa0 + i1 * sa1 + i2 * sa2 + i3 * sa3, mask=mask, other=0).to(tl.float32)
    b = tl.load(b_ptr + i0 * sb0 + i1 * sb1 + i2 * sb2 + i3 * sb3, mask=mask, other=0).to(tl.float32)
    a = (a - a_zp) * a_scale
    b = (b - b_zp) * b_scale
    y = _post_op(a * b if MUL else a + b, POST)
    tl.store(out_ptr + offs, _round_clamp(y * inv_out, out_zp, qmin, qmax).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def im2col(x_ptr, sn, sc, sh, sw, cols_ptr, M, K, MP, KP, C, H, W, HO, WO, stride_h, stride_w, pad_h, pad_w,
           dil_h, dil_w, KW, fill, FLIP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """The GEMM operand of a convolution (a linear: 1x1 over a 1x1 image), int8, (MP, KP) contiguous: row m an
    output pixel (n, oh, ow), column k a tap and channel (i, j, c), c fastest; codes of uint8 x shifted into int8
    (FLIP: x ^ 128), outside the image the zero point's code ``fill``, and zeros past (M, K)."""
    rm = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M))[:, None]
    rk = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
    ow = rm % WO
    oh = (rm // WO) % HO
    n = rm // (WO * HO)
    c = rk % C
    j = (rk // C) % KW
    i = rk // (C * KW)
    h = oh * stride_h - pad_h + i * dil_h
    w = ow * stride_w - pad_w + j * dil_w
    real = (rm < M) & (rk < K)
    inside = real & (h >= 0) & (h < H) & (w >= 0) & (w < W)
    v = tl.load(x_ptr + n * sn + c * sc + h * sh + w * sw, mask=inside, other=0).to(tl.int32)
    if FLIP:
        v = v - 128
    v = tl.where(inside, v, tl.where(real, fill, 0))
    tl.store(cols_ptr + rm * KP + rk, v.to(tl.int8), mask=(rm < MP) & (rk < KP))


@triton.jit
def _add(a, b):
    # tl.reduce's combine function; tl.sum and tl.zeros are Triton's own jit functions, which its interpreter
    # runs only when Triton was imported in interpreter mode (torch.utils.flop_counter imports it first)
    return a + b


@triton.jit
def global_average(q_ptr, sn, sc, sh, sw, out_ptr, C, HW, W, scale_over_hw, zp_hw, inv_out, out_zp, qmin, qmax,
                   BLOCK_C: tl.constexpr, BLOCK_HW: tl.constexpr):
    """Codes of the mean over H and W of each (n, c): the codes summed exactly in int32, then one rescale."""
    n = tl.program_id(0)
    rc = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    total = rc * 0  # int32 zeros
    for start in range(0, HW, BLOCK_HW):
        p = (start + tl.arange(0, BLOCK_HW))[:, None]
        mask = (p < HW) & (rc[None, :] < C)
        v = tl.load(q_ptr + n * sn + rc[None, :] * sc + (p // W) * sh + (p % W) * sw, mask=mask, other=0)
        total += tl.reduce(v.to(tl.int32), 0, _add)
    y = (total - zp_hw).to(tl.float32) * scale_over_hw
    tl.store(out_ptr + n * C + rc, _round_clamp(y * inv_out, out_zp, qmin, qmax).to(out_ptr.dtype.element_ty),
             mask=rc < C)
