"""The arithmetic every int8 kernel shares: fused post-ops, output dtypes, per-tensor quantize and
dequantize bit-identical to :mod:`lucid_fx.quantization.functional` (in-place, cached float32
scales), and the strides of a result (what the fake kernels promise). The reference kernels
(:mod:`lucid_fx.kernels.reference`) re-export these names; the fast ones reach them there as ``ref.*``."""

import functools
from typing import List, Optional

import torch

from lucid_fx.quantization.dtypes import QDtype, to_qdtype
from lucid_fx.quantization.functional import dequantize

__all__ = [
    "POST_OPS", "ONEDNN_POST_OPS", "ONEDNN_CONV_POST_OPS", "ONEDNN_CONV1D_POST_OPS", "onednn_post_op", "check_post_op", "out_storage", "f32", "f32_reciprocal", "dequant", "quant", "finish", "dense_strides",
    "to_layout", "conv2d_memory_format",
]

POST_OPS = ("none", "relu", "hardswish", "silu", "gelu", "gelu_tanh", "tanh", "sigmoid")  # applied in float before quantization
#: oneDNN's names for the post-ops (its eltwise "swish" with alpha 1 is silu; gelu with algorithm "none" is
#: the erf form, "tanh" the approximation) and their algorithm argument.
ONEDNN_POST_OPS = {"none": "none", "relu": "relu", "hardswish": "hardswish", "silu": "swish", "gelu": "gelu",
                   "gelu_tanh": "gelu", "tanh": "tanh"}
_ONEDNN_ALGORITHMS = {"gelu": "none", "gelu_tanh": "tanh"}
#: The post-ops oneDNN's int8 convolution takes (torch 2.13: "Unsupported post op gelu [tanh] for quantized
#: pointwise conv2d"); a linear with another one runs as oneDNN's linear, never as a 1x1 convolution.
ONEDNN_CONV_POST_OPS = ("none", "relu", "hardswish", "silu")
#: Its int8 conv1d takes relu alone ("Unsupported post op swish for quantized pointwise conv1d").
ONEDNN_CONV1D_POST_OPS = ("none", "relu")


def onednn_post_op(post_op: str) -> tuple:
    """The ``(name, args, algorithm)`` arguments of oneDNN's int8 ops for ``post_op``."""
    return ONEDNN_POST_OPS[post_op], [], _ONEDNN_ALGORITHMS.get(post_op, "")


def check_post_op(post_op: str) -> None:
    """Raise ValueError for a post-op the kernels do not fuse."""
    if post_op not in POST_OPS:
        raise ValueError(f"post_op must be one of {POST_OPS}, got {post_op!r}")


def out_storage(q: torch.Tensor, out_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype of an op's result: ``out_dtype``, or the codes' own integer dtype when None."""
    if out_dtype is None:
        return q.dtype
    if out_dtype not in (torch.uint8, torch.int8, torch.float32):
        raise ValueError(f"out_dtype must be None, torch.uint8, torch.int8 or torch.float32, got {out_dtype}")
    return out_dtype


@functools.lru_cache(maxsize=4096)
def f32(scale: float) -> float:
    """``scale`` rounded to float32, the value ``dequantize`` multiplies by (as a Python float)."""
    return float(torch.tensor(scale, dtype=torch.float32))


@functools.lru_cache(maxsize=4096)
def f32_reciprocal(scale: float) -> float:
    """``1 / scale`` taken in float32 exactly as ``quantize`` takes it; cached, as a small tensor
    division costs ~10 us, more than the rest of a small kernel."""
    return float(1.0 / torch.tensor(scale, dtype=torch.float32))


def dequant(q: torch.Tensor, scale: float, zero_point: int) -> torch.Tensor:
    """Float32 ``(q - zero_point) * scale`` for per-tensor 8-bit codes, bit-identical to ``dequantize``."""
    if q.dtype not in (torch.uint8, torch.int8):
        return dequantize(q, scale, zero_point)  # int32 codes: q - zp must be taken in int32
    # A Python float that is exactly a float32 value multiplies in float32 like a float32 tensor.
    y = q.to(torch.float32)
    return (y.sub_(zero_point) if zero_point else y).mul_(f32(scale))


def quant(
    y: torch.Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int, dtype: torch.dtype,
    overwrite: bool = False,
) -> torch.Tensor:
    """Codes ``clamp(round(y * (1 / scale)) + zero_point)`` in ``dtype``, bit-identical to ``quantize``.

    ``overwrite`` lets a float32 ``y`` that is a temporary of the caller hold the intermediates.
    """
    inv = f32_reciprocal(scale)
    y32 = y.to(torch.float32)
    codes = (y32.mul_(inv) if (overwrite or y32 is not y) else y32 * inv).round_()
    return (codes.add_(zero_point) if zero_point else codes).clamp_(quant_min, quant_max).to(dtype)


def finish(y: torch.Tensor, post_op: str, out_scale: float, out_zp: int, dtype: torch.dtype) -> torch.Tensor:
    """Apply the post-op to float ``y`` and quantize it to ``dtype`` (float32: no quantization).

    ``y`` is a temporary of the caller and is overwritten.
    """
    if post_op == "relu":
        y = y.relu_()
    elif post_op == "hardswish":
        y = torch.nn.functional.hardswish(y, inplace=True)
    elif post_op == "silu":
        y = torch.nn.functional.silu(y, inplace=True)
    elif post_op in ("gelu", "gelu_tanh"):
        y = torch.nn.functional.gelu(y, approximate="tanh" if post_op == "gelu_tanh" else "none")
    elif post_op == "tanh":
        y = y.tanh_()
    elif post_op == "sigmoid":
        y = y.sigmoid_()
    if dtype == torch.float32:
        return y
    info = torch.iinfo(dtype)
    return quant(y, out_scale, out_zp, info.min, info.max, dtype, overwrite=True)


def _check_range(quant_min: int, quant_max: int, dtype: torch.dtype) -> None:
    grid: QDtype = to_qdtype(dtype)
    if quant_min < grid.quant_min or quant_max > grid.quant_max or quant_min >= quant_max:
        raise ValueError(f"range [{quant_min}, {quant_max}] does not fit in {dtype}")


def _narrowed(q: torch.Tensor, quant_min: int, quant_max: int, dtype: torch.dtype) -> torch.Tensor:
    # quantize() clamps to the full grid of the storage dtype; clamping again to a sub-range is the
    # same as clamping once to it, so codes stay bit-identical to quantize() for every range.
    _check_range(quant_min, quant_max, dtype)
    grid: QDtype = to_qdtype(dtype)
    if (quant_min, quant_max) != (grid.quant_min, grid.quant_max):
        q = q.clamp_(quant_min, quant_max)
    return q


def dense_strides(shape: torch.Size, memory_format: torch.memory_format) -> List[int]:
    """Strides of a dense tensor of ``shape`` in ``memory_format``, as ``torch.empty`` gives them."""
    order = [0, 2, 3, 1] if memory_format == torch.channels_last else list(range(len(shape)))
    strides, step = [0] * len(shape), 1
    for dim in reversed(order):
        strides[dim] = step
        step *= max(shape[dim], 1)
    return strides


def to_layout(out: torch.Tensor, memory_format: torch.memory_format) -> torch.Tensor:
    """``out`` with exactly the strides a fake tensor of the op gets (copied only when needed).

    ``contiguous()`` ignores the strides of size-1 dims; graphs compiled from the fake kernels
    compare them too, so those are set by a free ``as_strided`` view of the same memory.
    """
    want = dense_strides(out.shape, memory_format)
    if list(out.stride()) == want:
        return out
    out = out.contiguous(memory_format=memory_format)
    return out if list(out.stride()) == want else out.as_strided(out.shape, want)


def conv2d_memory_format(qx: torch.Tensor) -> torch.memory_format:
    """Layout of a conv2d result: channels-last when ``qx`` is unambiguously channels-last.

    oneDNN computes in channels-last; a model whose input is converted once with
    ``x.contiguous(memory_format=torch.channels_last)`` then never pays a layout copy, while
    an NCHW input gets an NCHW result, as ``torch.nn.functional.conv2d`` would give.
    """
    if qx.dim() == 4 and qx.is_contiguous(memory_format=torch.channels_last) and not qx.is_contiguous():
        return torch.channels_last
    return torch.contiguous_format
