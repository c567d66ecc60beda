"""Reference int8 kernels: dequantize, run the float op, quantize.

Each function here has the exact signature of its ``lucid_fx::`` op and is that op's default
implementation (any device without a faster kernel), and the oracle the fast kernels are
tested against. Integer codes are plain ``uint8``/``int8`` tensors with per-tensor affine
qparams; weights are ``int8`` with per-channel symmetric scales (zero points 0).

Output codes keep the integer dtype of the (first) input unless ``out_dtype`` says otherwise:
``uint8`` in, ``uint8`` out.

Per-tensor quantize and dequantize are written with in-place ops (:func:`dequant`,
:func:`quant`, in :mod:`lucid_fx.kernels.codes`): the same float32 arithmetic as
:func:`lucid_fx.quantization.quantize` / ``dequantize``, so codes agree to the bit, at 2-10x
their speed (fewer temporaries).
"""

from typing import Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F

from lucid_fx.kernels.codes import (  # noqa: F401  (re-exported: the fast kernels read them as ref.*)
    ONEDNN_CONV_POST_OPS, ONEDNN_CONV1D_POST_OPS, ONEDNN_POST_OPS, POST_OPS, onednn_post_op, _check_range, _narrowed, check_post_op, conv2d_memory_format, dense_strides, dequant, f32, f32_reciprocal,
    finish, out_storage, quant, to_layout,
)
from lucid_fx.quantization.dtypes import to_qdtype
from lucid_fx.quantization.functional import dequantize, quantize

__all__ = [
    "quantize_per_tensor", "dequantize_per_tensor", "quantize_per_channel", "dequantize_per_channel",
    "linear", "conv1d", "conv2d", "conv2d_add", "add", "mul", "matmul", "lut", "softmax", "cat",
    "avg_pool2d", "adaptive_avg_pool2d", "mean", "make_lut",
]

def quantize_per_tensor(
    x: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype
) -> torch.Tensor:
    """``clamp(round(x * (1 / scale)) + zero_point, quant_min, quant_max)`` in ``dtype`` (uint8/int8/int32)."""
    _check_range(quant_min, quant_max, dtype)
    return quant(x, scale, zero_point, quant_min, quant_max, dtype)


def dequantize_per_tensor(q: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """Float32 ``(q - zero_point) * scale``."""
    return dequant(q, scale, zero_point)


def quantize_per_channel(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int, quant_min: int, quant_max: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`quantize_per_tensor` with one scale and zero point per index of dim ``axis``."""
    q = quantize(x, scale, zero_point, to_qdtype(dtype), ch_axis=axis)
    return _narrowed(q, quant_min, quant_max, dtype)


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int) -> torch.Tensor:
    """:func:`dequantize_per_tensor` with one scale and zero point per index of dim ``axis``."""
    return dequantize(q, scale, zero_point, ch_axis=axis)


def _weight(qw: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    return dequantize(qw, w_scale, torch.zeros_like(w_scale, dtype=torch.int32), ch_axis=0)


def linear(
    qx: torch.Tensor, x_scale: float, x_zp: int, qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
    out_scale: float, out_zp: int, post_op: str, out_dtype: Optional[torch.dtype],
) -> torch.Tensor:
    """``post_op(x @ w.T + bias)`` of int8 codes, quantized with ``(out_scale, out_zp)``.

    Args:
        qx: activation codes (..., K), uint8 (or int8), per-tensor ``(x_scale, x_zp)``.
        qw: weight codes (N, K), int8 on :func:`~lucid_fx.kernels.weight_quant_range`, zero points 0.
        w_scale: float (N,) per-output-channel scales (all equal for a per-tensor weight).
        bias: float (N,) or None.
        post_op: "none" or "relu", applied before quantization.
        out_dtype: None for codes of ``qx``'s dtype, ``torch.uint8``/``torch.int8``, or
            ``torch.float32`` for the float result (``out_scale``/``out_zp`` are then unused).
    """
    check_post_op(post_op)
    y = F.linear(dequant(qx, x_scale, x_zp), _weight(qw, w_scale), bias)
    return finish(y, post_op, out_scale, out_zp, out_storage(qx, out_dtype))


def _conv(conv, qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups) -> torch.Tensor:
    return conv(dequant(qx, x_scale, x_zp), _weight(qw, w_scale), bias, stride, padding, dilation, groups)


def conv1d(
    qx: torch.Tensor, x_scale: float, x_zp: int, qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
    stride: List[int], padding: List[int], dilation: List[int], groups: int, out_scale: float, out_zp: int,
    post_op: str, out_dtype: Optional[torch.dtype],
) -> torch.Tensor:
    """:func:`conv2d` in one spatial dim (one-element ``stride``/``padding``/``dilation``); NCL result."""
    check_post_op(post_op)
    y = _conv(F.conv1d, qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups)
    return to_layout(finish(y, post_op, out_scale, out_zp, out_storage(qx, out_dtype)), torch.contiguous_format)


def conv2d(
    qx: torch.Tensor, x_scale: float, x_zp: int, qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
    stride: List[int], padding: List[int], dilation: List[int], groups: int, out_scale: float, out_zp: int,
    post_op: str, out_dtype: Optional[torch.dtype],
) -> torch.Tensor:
    """``post_op(conv2d(x, w, bias))`` of int8 codes; arguments as :func:`linear`, weight (O, C/groups, kh, kw).

    Grouped and depthwise convolutions included. The result is channels-last when ``qx`` is
    (see :func:`conv2d_memory_format`), else NCHW.
    """
    check_post_op(post_op)
    y = _conv(F.conv2d, qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups)
    return to_layout(finish(y, post_op, out_scale, out_zp, out_storage(qx, out_dtype)), conv2d_memory_format(qx))


def conv2d_add(
    qx: torch.Tensor, x_scale: float, x_zp: int, qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
    stride: List[int], padding: List[int], dilation: List[int], groups: int, qother: torch.Tensor,
    other_scale: float, other_zp: int, out_scale: float, out_zp: int, post_op: str, out_dtype: Optional[torch.dtype],
) -> torch.Tensor:
    """``post_op(conv2d(x) + other)`` (a residual block); ``other`` broadcasts to the conv result."""
    check_post_op(post_op)
    y = _conv(F.conv2d, qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups)
    y = y + dequant(qother, other_scale, other_zp)
    return to_layout(finish(y, post_op, out_scale, out_zp, out_storage(qx, out_dtype)), conv2d_memory_format(qx))


def add(
    qa: torch.Tensor, a_scale: float, a_zp: int, qb: torch.Tensor, b_scale: float, b_zp: int,
    out_scale: float, out_zp: int, post_op: str,
) -> torch.Tensor:
    """``post_op(a + b)`` of per-tensor codes (broadcasting); the result has ``qa``'s dtype."""
    check_post_op(post_op)
    y = dequant(qa, a_scale, a_zp) + dequant(qb, b_scale, b_zp)
    return finish(y, post_op, out_scale, out_zp, qa.dtype)


def mul(
    qa: torch.Tensor, a_scale: float, a_zp: int, qb: torch.Tensor, b_scale: float, b_zp: int,
    out_scale: float, out_zp: int, post_op: str,
) -> torch.Tensor:
    """``post_op(a * b)`` of per-tensor codes (broadcasting); the result has ``qa``'s dtype."""
    check_post_op(post_op)
    y = dequant(qa, a_scale, a_zp) * dequant(qb, b_scale, b_zp)
    return finish(y, post_op, out_scale, out_zp, qa.dtype)


def matmul(
    qa: torch.Tensor, a_scale: float, a_zp: int, qb: torch.Tensor, b_scale: float, b_zp: int,
    out_scale: float, out_zp: int,
) -> torch.Tensor:
    """Batched ``a @ b`` as a float32 matmul of ``(q - zp)``, scaled once by ``a_scale * b_scale``.

    The operands are small integers (|v| <= 255), exact in float32 and even in TF32, so each
    product is exact and only the accumulation rounds. This is also the CPU and CUDA kernel:
    measured on 2 AVX2 cores (no VNNI), ViT-B attention scores (1x12x197x64 @ 1x12x64x197)
    take 1.8 ms for this whole op against 18.5 ms for the bare ``torch._int_mm`` GEMMs (one
    per head; CPU ``_int_mm`` runs at 2-6 GOPS, float32 ``bmm`` at 70-130), and CUDA's
    ``_int_mm`` has no batched form.
    """
    a = qa.to(torch.float32).sub_(a_zp)
    b = qb.to(torch.float32).sub_(b_zp)
    y = torch.matmul(a, b).mul_(f32(a_scale) * f32(b_scale))
    return finish(y, "none", out_scale, out_zp, qa.dtype)


def lut(q: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``table[code]`` for each code; int8 codes index from -128 (``table[code + 128]``)."""
    if table.numel() != 256:
        raise ValueError(f"a lookup table has 256 entries, got {table.numel()}")
    if q.dtype == torch.int8:
        # code + 128 is the code's bit pattern with the sign bit flipped, read as uint8.
        index = q.view(torch.uint8) ^ 128
    elif q.dtype == torch.uint8:
        index = q
    else:
        raise ValueError(f"lut reads uint8 or int8 codes, got {q.dtype}")
    out = _lookup(table.to(q.device), index)
    like = torch.empty_like(q, dtype=out.dtype)  # results keep the layout of the codes, as torch's elementwise ops do
    return out if like.stride() == out.stride() else like.copy_(out)


def _lookup(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]``. A row-wise gather from the table broadcast over rows of 1024 codes runs
    in parallel and measured 1.05 ms per million codes against 1.8 ms for ``torch.take``
    (2 cores, AVX2); small or oddly sized tensors keep ``take``."""
    flat = index.reshape(-1).to(torch.int64)
    n = flat.numel()
    width = 1024 if n % 1024 == 0 else (index.shape[-1] if index.dim() and index.shape[-1] >= 64 else 0)
    if width == 0 or n < 4096:
        return torch.take(table, flat).view(index.shape)
    rows = flat.view(-1, width)
    return torch.gather(table.expand(rows.shape[0], table.numel()), 1, rows).view(index.shape)


def softmax(q: torch.Tensor, scale: float, zp: int, dim: int, out_scale: float, out_zp: int) -> torch.Tensor:
    """Softmax along ``dim``, quantized with ``(out_scale, out_zp)`` (``1/256, 0`` suits uint8)."""
    y = torch.softmax(dequant(q, scale, zp), dim)
    return finish(y, "none", out_scale, out_zp, q.dtype)


def cat(
    qs: List[torch.Tensor], scales: List[float], zps: List[int], dim: int, out_scale: float, out_zp: int
) -> torch.Tensor:
    """Concatenate codes along ``dim``; inputs already on ``(out_scale, out_zp)`` are copied, not requantized."""
    if not (len(qs) == len(scales) == len(zps)) or not qs:
        raise ValueError(f"cat needs one scale and zero point per tensor, got {len(qs)}, {len(scales)}, {len(zps)}")
    dtype = qs[0].dtype
    info = torch.iinfo(dtype)
    parts = [
        q if (s, z, q.dtype) == (out_scale, out_zp, dtype)
        else quant(dequant(q, s, z), out_scale, out_zp, info.min, info.max, dtype, overwrite=True)
        for q, s, z in zip(qs, scales, zps)
    ]
    return torch.cat(parts, dim)


def avg_pool2d(
    q: torch.Tensor, scale: float, zp: int, kernel_size: List[int], stride: List[int], padding: List[int],
    ceil_mode: bool, count_include_pad: bool, out_scale: float, out_zp: int,
) -> torch.Tensor:
    """``F.avg_pool2d`` of per-tensor codes; an empty ``stride`` means ``kernel_size``."""
    y = F.avg_pool2d(dequant(q, scale, zp), kernel_size, stride or None, padding, ceil_mode, count_include_pad)
    return to_layout(finish(y, "none", out_scale, out_zp, q.dtype), _pool_format(q))


def adaptive_avg_pool2d(
    q: torch.Tensor, scale: float, zp: int, output_size: List[int], out_scale: float, out_zp: int
) -> torch.Tensor:
    """``F.adaptive_avg_pool2d`` of per-tensor codes."""
    y = F.adaptive_avg_pool2d(dequant(q, scale, zp), output_size)
    return to_layout(finish(y, "none", out_scale, out_zp, q.dtype), _pool_format(q))


def _pool_format(q: torch.Tensor) -> torch.memory_format:
    return conv2d_memory_format(q) if q.dim() == 4 else torch.contiguous_format


def mean(
    q: torch.Tensor, scale: float, zp: int, dim: List[int], keepdim: bool, out_scale: float, out_zp: int
) -> torch.Tensor:
    """Mean over ``dim`` of per-tensor codes."""
    y = dequant(q, scale, zp).mean(dim, keepdim)
    return to_layout(finish(y, "none", out_scale, out_zp, q.dtype), torch.contiguous_format)


def make_lut(
    fn: Callable[[torch.Tensor], torch.Tensor], in_scale: float, in_zp: int, in_qdtype_range: Tuple[int, int],
    out_scale: float, out_zp: int, out_range: Tuple[int, int],
) -> torch.Tensor:
    """The 256-entry table of ``lucid_fx::lut`` for an elementwise ``fn``: ``quantize(fn(dequantize(code)))``.

    ``fn`` is called once, on the float values of the codes ``in_qdtype_range[0] ..
    in_qdtype_range[1]`` in order. The table is indexed by storage code (``uint8`` when the
    input range is non-negative, else ``int8`` from -128); entries for codes outside the range,
    which never occur, repeat the nearest end. The table's dtype is ``uint8`` for a
    non-negative ``out_range``, else ``int8``.

    >>> table = make_lut(torch.sigmoid, 0.1, 128, (0, 255), 1 / 256, 0, (0, 255))
    >>> table.dtype, table.shape, table[128].item(), table[255].item()
    (torch.uint8, torch.Size([256]), 128, 255)
    """
    qmin, qmax = in_qdtype_range
    in_storage = torch.uint8 if qmin >= 0 else torch.int8
    storage_min = torch.iinfo(in_storage).min
    if qmin < storage_min or qmax > torch.iinfo(in_storage).max or qmin >= qmax:
        raise ValueError(f"input range {in_qdtype_range} is not an 8-bit grid")
    codes = torch.arange(qmin, qmax + 1, dtype=torch.int32)
    values = torch.as_tensor(fn(dequantize(codes, in_scale, in_zp)), dtype=torch.float32)
    if values.shape != codes.shape:
        raise ValueError(f"make_lut: fn must map {codes.numel()} values elementwise, got shape {tuple(values.shape)}")
    out_storage = torch.uint8 if out_range[0] >= 0 else torch.int8
    table_codes = _narrowed(quantize(values, out_scale, out_zp, to_qdtype(out_storage)), *out_range, out_storage)
    # Index = storage code - storage min; codes outside [qmin, qmax] cannot occur, so clamp into it.
    index = torch.arange(256).clamp(qmin - storage_min, qmax - storage_min) - (qmin - storage_min)
    return table_codes[index].contiguous()


def max_pool2d(
    q: torch.Tensor, kernel_size: List[int], stride: List[int], padding: List[int], dilation: List[int], ceil_mode: bool
) -> torch.Tensor:
    """``F.max_pool2d`` of codes (order-preserving, so the qparams carry over unchanged).

    Runs in int16, keeping the input's layout: torch 2.13's uint8 max-pool is slow on NCHW
    (4.6 ms for 64x112x112, 3x3/2) and rejects channels-last; int16 channels-last takes 0.35 ms.
    CUDA's max-pool takes floating types alone: there the codes pool as float32, which holds them exactly."""
    fmt = _pool_format(q)
    work = torch.int16 if q.device.type == "cpu" else torch.float32
    y = F.max_pool2d(q.to(work), kernel_size, stride or kernel_size, padding, dilation, ceil_mode)
    return to_layout(y.to(q.dtype), fmt)
