"""int8 convolutions on CPUs without VNNI in lucid_fx's own kernels (``native_conv.c``), with oneDNN's values.

oneDNN's int8 convolution costs 66 us a call there for 8 channels on 4x4 (measured, 1 thread, AVX2
EPYC, torch 2.13, on a prepacked weight; 17 us here); the small convolutions of mobile networks and
of small images are mostly that cost. Two kernels: an implicit GEMM for dense convolutions (the blocks
of :mod:`lucid_fx.kernels.linear_native`, each pixel's row read tap by tap) and a depthwise one.
Both take uint8 channels-last codes (the dense one 7-bit weights, the depthwise one any), and end with the float steps of oneDNN's
AVX2 kernels (:mod:`lucid_fx.kernels.linear_native`), so their codes are oneDNN's, bit for bit
(tests/kernels/test_conv_native.py compares them on this machine's oneDNN where it runs those
kernels, and with exact sums everywhere). Built on a CPU with VNNI, the dense kernel takes every
int8 weight too, and with VNNI's float steps (``engine="int_mm"``) both serve the VNNI engine's
convolutions of few output pixels (:data:`VNNI_PIXELS`; depthwise :data:`VNNI_DEPTHWISE_PIXELS`), where oneDNN's
call costs most.

>>> qw = torch.ones(1, 4, 3, 3, dtype=torch.int8)  # a 3x3 box sum over 4 channels
>>> conv = native_conv(qw, torch.ones(1), None, 1.0, 0, (1, 1), 1, None, "none")
>>> x = torch.full((1, 4, 3, 3), 2, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
>>> y = conv_codes(x, conv, (1, 1), (1, 1), (1, 1), 0, 0, -float('inf'), float('inf'), torch.float32)
>>> y[0, 0] / 4  # 2 per tap inside the image: 4 taps at a corner, 6 on an edge, 9 in the middle
tensor([[ 8., 12.,  8.],
        [12., 18., 12.],
        [ 8., 12.,  8.]])
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from lucid_fx.kernels import linear_native
from lucid_fx.kernels.codes import f32_reciprocal
from lucid_fx.kernels.linear_row import (conv_is_row, engine_post_ops, few_rows_engine_here, float_post_op, small_gemm,
                                         takes_row)
from lucid_fx.kernels.native import bind
from lucid_fx.kernels.onednn_steps import CONV_POST_OPS, VNNI_STEPS, conv_steps
from lucid_fx.kernels.target import Target
from lucid_fx.kernels.zero_point import _unpadded_zero_point
from lucid_fx.kernels.native_step import returns_step

__all__ = ["NativeConv", "native_conv", "conv_codes", "takes_conv", "native_engine", "silu_after_float", "amx_conv_engine",
           "post_op_after_float", "out_size", "DEPTHWISE_MACS", "DENSE_MACS", "VNNI_PIXELS", "VNNI_DEPTHWISE_PIXELS"]


# A depthwise convolution takes the native kernel up to this many multiply-adds: measured on an AVX2
# EPYC, 1 thread, against oneDNN's call on a prepacked weight: 108 against 143 us for 72 channels 3x3
# stride 2 on 56x56, 71 against 141 for 576 channels 5x5 on 7x7, 163 against 205 for 144 channels 3x3
# on 28x28; but 604 against 590 for 144 channels on 56x56 (4.1M), 872 against 463 for 32 on 112x112.
DEPTHWISE_MACS = 1 << 21
# A dense convolution takes it up to this many multiply-adds, where oneDNN's fixed cost a call weighs
# most. Measured the same way against oneDNN's call on a prepacked weight: native / oneDNN 0.46-0.78
# for 3x3 convolutions of 2.4M (16-64 channels, 8x8 to 32x32); 0.95-1.06 at 58-116M (ResNet-18's
# first widths); inside models, the DenseNet-like family 1.59 against 1.86 ms, but the ResNet-18-like
# model with native convolutions up to 4096 output pixels 28.4 against 27.6 ms.
DENSE_MACS = 1 << 24
# With VNNI (the dense kernel's steps are vpdpbusd there, native_gemm.h), oneDNN's own kernels are
# faster past small images; both kernels take convolutions of up to this many output pixels there.
# Measured, 1 thread, AVX512-VNNI EPYC, us native / oneDNN on a prepacked weight: depthwise 7x7 on
# 2x32x8x8 33 / 52, 2x64x4x4 19 / 49, 5x5 on 1x576x7x7 54 / 100, 3x3 on 2x144x8x8 39 / 61, but
# 2x16x16x16 98 / 63, 1x96x28x28 96 / 71; dense 3x3 on 2x64x8x8 71 / 111, 2x128x4x4 69 / 174, 1x1 on
# 2x64x8x8 to 128 channels 44 / 66, but 3x3 on 2x16x32x32 151 / 127, 1x64x56x56 1331 / 718.
VNNI_PIXELS = 128
# A depthwise one up to this many (a 14x14 image), whatever its multiply-adds: measured on the same EPYC, us native /
# oneDNN on a prepacked weight, 1 and 2 threads, 14x14 5x5 with 120-672 channels 41-140 / 78-171 and 39-78 / 74-129,
# 3x3 with 480 66 / 97 and 65 / 84, with a hardswish post-op the same; at 784 pixels (88 channels 3x3 on 28x28) equal.
VNNI_DEPTHWISE_PIXELS = 196


@dataclass(frozen=True)
class NativeConv:
    """A convolution's constants for :func:`conv_codes`, decided once: the weight in native_conv.c's
    layout (dense: a linear of (kh, kw, c rounded up to 4) inputs in native_gemm.c's blocks;
    depthwise: int16 (kh * kw, c rounded up to 16)), and oneDNN's float steps (its AVX2 kernels:
    ``x_scale * w_scale`` multiplied first; its VNNI kernels': ``x_scale`` first, then ``scale``; the
    zero point folded into the bias where it folds it, else taken away by the int32 ``offset``)."""

    weight: torch.Tensor
    depthwise: bool
    kernel: Tuple[int, int]
    cout: int
    int8: torch.Tensor  # (cout, c/groups, kh, kw): the codes, for the torch path
    offset: torch.Tensor  # (cout,) int32
    scale: torch.Tensor  # (cout,) float32
    bias: Optional[torch.Tensor]  # (cout,) float32
    inv_out: float  # float32 1 / out_scale (0 for a float result)
    hardswish: bool  # oneDNN's hardswish post-op (linear_native.hardswish)
    x_scale: float = 1.0  # the first step's factor: 1 where scale holds both scales (AVX2's order)


def takes_conv(x_shape: Sequence[int], qw: torch.Tensor, groups: int, stride: Sequence[int],
               padding: Sequence[int], dilation: Sequence[int], engine: str = "native") -> bool:
    """Whether the kernels take this convolution, and are measured faster there than oneDNN: dense
    with channels a multiple of 4 (fewer, as an RGB stem's 3, were measured 4x slower) up to
    DENSE_MACS multiply-adds, or depthwise (one output per channel) up to DEPTHWISE_MACS; on the
    VNNI engine (``"int_mm"``, whose oneDNN kernels are faster) dense ones of up to VNNI_PIXELS output pixels
    and depthwise ones of up to VNNI_DEPTHWISE_PIXELS instead."""
    n, cin, h, w = x_shape
    if qw.dim() != 4 or not (groups == 1 and cin % 4 == 0 or groups == cin == qw.shape[0] and qw.shape[1] == 1):
        return False
    ho, wo = out_size(h, w, qw.shape[2:], stride, padding, dilation)
    pixels, macs = n * ho * wo, n * ho * wo * qw.numel()  # each output pixel: cout x (cin / groups) x kh x kw
    if engine != "native" and groups > 1:
        return pixels <= VNNI_DEPTHWISE_PIXELS
    return macs <= (DENSE_MACS if groups == 1 else DEPTHWISE_MACS) and (engine == "native" or pixels <= VNNI_PIXELS)


def native_engine(engine: Optional[str]) -> bool:
    """Whether ``engine`` (linear_row.takes_row's) runs lucid_fx's own GEMM and convolutions: the native engine, or the
    VNNI one where the native build has VNNI steps (linear_native.full_grid)."""
    return engine == "native" or engine == "int_mm" and linear_native.full_grid()


def silu_after_float(target: Target, onednn_on: bool, x_shape: Sequence[int], qw: torch.Tensor, groups: int,
                     stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int]) -> bool:
    """Whether a convolution with a SiLU post-op computes its float32 result, then torch's SiLU and the codes
    (native.post_op_codes), where oneDNN fuses its swish (which approximates exp, as linear_row.FLOAT_POST_OPS
    says): a depthwise one these kernels take on ``target`` (the program runs it here, the portable op in oneDNN,
    their float32 results equal), so both give the same codes. Measured, us, 1 and 2 threads, AVX512-VNNI EPYC, the
    native kernel and the SiLU pass / oneDNN's swish: 1152 channels 5x5 on 7x7 94 / 144 and 71 / 121, 672 on 14x14
    208 / 233 and 120 / 155, 480 3x3 116 / 137 and 95 / 102."""
    if groups == 1 or len(x_shape) != 4 or qw.dim() != 4:
        return False
    pixels = x_shape[0] * math.prod(out_size(*x_shape[2:], qw.shape[2:], stride, padding, dilation))
    # (an AMX CPU keeps oneDNN's swish: its depthwise SiLU convolutions on these kernels measured no faster there,
    # EfficientNet-like 10.1-10.3 against 10.0-10.1 ms, 2 threads)
    engine = takes_row(target, onednn_on, "none", torch.float32, pixels, qw.shape[0], qw[0].numel())
    return native_engine(engine) and takes_conv(x_shape, qw, groups, stride, padding, dilation, engine)


def amx_conv_engine(target: Target, onednn_on: bool, x_shape: Sequence[int], qw: torch.Tensor, stride, padding,
                    dilation, groups: int, post_op: str, dtype: torch.dtype, pixels: int,
                    pointwise: bool) -> Tuple[Optional[str], Optional[str]]:
    """(engine, steps) of a convolution on an AMX CPU, where oneDNN runs it on its VNNI kernels (asked of oneDNN once
    per shape and post-op: :func:`lucid_fx.kernels.onednn_steps.conv_steps`), whose float steps the VNNI engine's
    kernels compute: the sizes and post-ops the engine takes on an AVX512-VNNI CPU. (None, None) elsewhere.
    MobileNetV3-like 3.91 -> 2.66 ms, 2 threads."""
    if (target.row_limit is None or target.linear_row != "int_mm" or few_rows_engine_here() != "int_mm"
            or not onednn_on or dtype not in (torch.uint8, torch.float32)
            or post_op not in CONV_POST_OPS or post_op not in engine_post_ops("int_mm")
            or not small_gemm(pixels, qw.shape[0], qw[0].numel(), "int_mm", pointwise)):
        return None, None
    steps = conv_steps(tuple(x_shape), tuple(qw.shape), tuple(stride), tuple(padding), tuple(dilation), groups, post_op,
                       torch.get_num_threads())
    return ("int_mm", steps) if steps == VNNI_STEPS else (None, None)


def post_op_after_float(target: Target, onednn_on: bool, post_op: str, dtype: torch.dtype, x_shape: Sequence[int],
                        qw: torch.Tensor, groups: int, stride: Sequence[int], padding: Sequence[int],
                        dilation: Sequence[int]) -> bool:
    """Whether a convolution oneDNN would fuse ``post_op`` into computes it after its float32 result instead, the
    portable kernel (lucid_fx.kernels.cpu) and the program alike: one of one row (squeeze-excite's reduction) as a
    linear would (linear_row.float_post_op), a depthwise SiLU one as :func:`silu_after_float` says."""
    if conv_is_row(x_shape, qw.shape, padding, groups):
        return float_post_op(target, onednn_on, post_op, dtype)
    return post_op == "silu" and silu_after_float(target, onednn_on, x_shape, qw, groups, stride, padding, dilation)


def native_conv(qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor], x_scale: float, x_zp: int,
                padding: Sequence[int], groups: int, out_scale: Optional[float], post_op: str,
                engine: str = "native") -> Optional[NativeConv]:
    """The constants of :func:`conv_codes` (``out_scale`` None: a float result; ``post_op`` none, relu
    (the caller's clamp bounds) or hardswish), from a copy of ``qw``; None where a code is past the
    exact int16 pair sums of the dense kernel (:data:`linear_native.PAIR_SAFE`) in a build without
    VNNI; the depthwise one sums in int32 and takes any codes. ``engine`` is the float steps' order:
    oneDNN's AVX2 kernels' (``"native"``: the two scales multiplied first) or its VNNI kernels'
    (``"int_mm"``: one at a time, measured equal to them on every value of a float result)."""
    cout, cin, kh, kw = qw.shape
    if groups == 1 and not linear_native.takes_weight(qw):
        return None
    zp_left, bias = _unpadded_zero_point(qw, w_scale, bias, x_scale, x_zp, padding)
    sums = qw.flatten(1).sum(1, dtype=torch.int32)
    if engine == "native":  # oneDNN's AVX2 kernels: the two scales' product first
        step, scale = 1.0, torch.tensor(x_scale, dtype=torch.float32) * w_scale.to(torch.float32)
    else:  # its VNNI kernels: acc * x_scale, then * w_scale
        step, scale = x_scale, w_scale.to(torch.float32)
    inv_out = 0.0 if out_scale is None else f32_reciprocal(out_scale)
    if groups > 1:  # centred sums: the offset puts back what oneDNN's folded bias expects
        taps = torch.zeros(kh * kw, -(-cout // 16) * 16, dtype=torch.int16)
        taps[:, :cout] = qw.reshape(cout, kh * kw).T
        return NativeConv(taps, True, (kh, kw), cout, qw.clone(), (x_zp - zp_left) * sums, scale, bias, inv_out,
                          post_op == "hardswish", step)
    rows = torch.zeros(cout, kh, kw, -(-cin // 4) * 4, dtype=torch.int8)
    rows[..., :cin] = qw.permute(0, 2, 3, 1)
    packed = linear_native.packed_weight(rows.reshape(cout, -1)).packed
    return NativeConv(packed, False, (kh, kw), cout, qw.clone(), -zp_left * sums, scale, bias, inv_out,
                      post_op == "hardswish", step)


def out_size(h, w, kernel, stride, padding, dilation) -> Tuple[int, int]:
    """A convolution's output (height, width)."""
    return tuple((size + 2 * p - d * (k - 1) - 1) // s + 1
                 for size, k, s, p, d in zip((h, w), kernel, stride, padding, dilation))


@returns_step("x")
def conv_codes(x: torch.Tensor, conv: NativeConv, stride: Sequence[int], padding: Sequence[int],
               dilation: Sequence[int], x_zp: int, zp: int, low: float, high: float, dtype: torch.dtype,
               plan: Optional[Callable] = None) -> torch.Tensor:
    """The convolution of uint8 channels-last codes ``x`` (zero point ``x_zp``, the padding's code):
    ``FINISH(((sums + offset) * scale + bias)`` with the clamp and rounding of
    :func:`lucid_fx.kernels.linear_native.gemm_rows`, where ``sums`` are the dense kernel's raw sums
    (the padding read as ``x_zp``) or the depthwise kernel's centred ones. A channels-last result.
    ``plan``: :func:`conv_plan`'s."""
    if plan is None:
        plan = conv_plan(x, conv, stride, padding, dilation, x_zp, zp, low, high, dtype)
    out = None if plan is None else plan(x)
    if out is not None:
        return out
    ho, wo = out_size(*x.shape[2:], conv.kernel, stride, padding, dilation)
    out = torch.empty((x.shape[0], conv.cout, ho, wo), dtype=dtype, memory_format=torch.channels_last)
    return _conv_torch(x, conv, stride, padding, dilation, x_zp, zp, low, high, out)


def conv_plan(x: torch.Tensor, conv: NativeConv, stride: Sequence[int], padding: Sequence[int], dilation: Sequence[int],
              x_zp: int, zp: int, low: float, high: float, dtype: torch.dtype) -> Optional[Callable]:
    """:func:`conv_codes`' native call for codes laid out as ``x`` (its geometry and scalars made once):
    ``step(x)``, or None for codes of other strides. None where the native kernel does not take them."""
    if not (x.is_cpu and x.dtype == torch.uint8 and x.is_contiguous(memory_format=torch.channels_last)):
        return None
    n, c, h, w = x.shape
    ho, wo = out_size(h, w, conv.kernel, stride, padding, dilation)
    call = bind("conv", dtype, int(conv.depthwise), x_zp, conv.x_scale, conv.inv_out, zp, low, high,
                linear_native.POST["hardswish" if conv.hardswish else "none"])
    if call is None:
        return None
    geometry = torch.tensor([n, h, w, c, *conv.kernel, *stride, *padding, *dilation, ho, wo, conv.cout], dtype=torch.int64)
    pointers = (conv.weight.data_ptr(), geometry.data_ptr(), conv.offset.data_ptr(), conv.scale.data_ptr(),
                None if conv.bias is None else conv.bias.data_ptr())
    weight, geometry_p, offset, scale, bias = pointers
    shape, strides, x_strides = (n, conv.cout, ho, wo), torch.empty(
        (n, conv.cout, ho, wo), memory_format=torch.channels_last, device="meta").stride(), x.stride()

    def conv_step(x: torch.Tensor) -> Optional[torch.Tensor]:
        if x.stride() != x_strides or x.dtype != torch.uint8:
            return None
        out = torch.empty_strided(shape, strides, dtype=dtype)
        call(x.data_ptr(), weight, out.data_ptr(), geometry_p, offset, scale, bias)
        return out

    conv_step.operands = (conv, geometry)  # kept alive with the pointers bound
    return conv_step


def _conv_torch(x, conv, stride, padding, dilation, x_zp, zp, low, high, out):
    """The same values in torch: float64 sums are exact at these sizes (< 2^53)."""
    xd = F.pad(x.to(torch.float64), [padding[1], padding[1], padding[0], padding[0]], value=float(x_zp))
    groups = x.shape[1] if conv.depthwise else 1
    sums = F.conv2d(xd - (x_zp if conv.depthwise else 0), conv.int8.to(torch.float64), None, stride, 0, dilation, groups)
    y = sums.to(torch.int32).add_(conv.offset.view(1, -1, 1, 1)).to(torch.float32)
    y = y.mul_(torch.tensor(conv.x_scale, dtype=torch.float32)).mul_(conv.scale.view(1, -1, 1, 1))
    y = y if conv.bias is None else y.add_(conv.bias.view(1, -1, 1, 1))
    return out.copy_(linear_native.finish(y, conv.inv_out, zp, low, high, out.dtype, "hardswish" if conv.hardswish else "none"))
