"""Lowering rule for a transposed convolution whose kernel equals its stride (a U-Net's 2x2, stride-2 upsampling).

Each input pixel then paints a kh x kw block of the output of its own, with no overlap: the op is a 1x1
convolution to ``Cout * kh * kw`` channels, ``W'[(co * kh + i) * kw + j, ci] = W[ci, co, i, j]`` (the bias
repeated for each of a block's pixels), whose result ``pixel_shuffle`` moves into the blocks. So it runs as
``lucid_fx.conv2d`` (an int8 kernel; a scale per row of ``W'``, finer than per output channel) and a move of its
codes. Other geometries (padding, output padding, groups, dilation, a kernel larger than the stride: blocks
that overlap and sum) decline and run in float.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx import _meta
from lucid_fx.ops import canonical
from lucid_fx.quantization.weight import quantize_weight
from lucid_fx.rules.lowering_context import QValue

__all__ = ["lower_conv_transpose2d"]

_ops = torch.ops.lucid_fx


def _pair(value: Any) -> Optional[tuple]:
    return (value, value) if isinstance(value, int) else tuple(value) if isinstance(value, (tuple, list)) else None


def _parts(ctx, node: fx.Node) -> Optional[tuple]:
    """(weight, bias, kernel, stride, padding, output padding, groups, dilation) of a module or F call."""
    if node.op == "call_module":
        m = ctx.prepared.get_submodule(node.target)
        if m.padding_mode != "zeros":
            return None
        return m.weight, m.bias, m.kernel_size, m.stride, m.padding, m.output_padding, m.groups, m.dilation
    args = canonical(node).args
    weight, bias = ctx.constant_value(args.get("weight")), ctx.constant_value(args.get("bias"))
    if weight is None or (args.get("bias") is not None and bias is None):
        return None
    get = lambda name, default: _pair(args.get(name, default))  # noqa: E731
    return (weight, bias, tuple(weight.shape[2:]), get("stride", 1), get("padding", 0), get("output_padding", 0),
            args.get("groups", 1), get("dilation", 1))


def lower_conv_transpose2d(ctx, members, resolve) -> Optional[QValue]:
    node = members[0]
    source = resolve(canonical(node).args.get("input"))
    parts = _parts(ctx, node)
    if parts is None or not isinstance(source, fx.Node) or not ctx.has_quant(source) or ctx.qparams_of(node) is None:
        return None
    weight, bias, kernel, stride, padding, output_padding, groups, dilation = parts
    batched = len(getattr(source.meta.get(_meta.TENSOR_META), "shape", ())) == 4
    blocks = weight.dim() == 4 and kernel[0] == kernel[1] and tuple(stride) == tuple(kernel)  # one block a pixel
    if not (batched and blocks) or any(padding) or any(output_padding) or groups != 1 or tuple(dilation) != (1, 1):
        return None
    cin, cout, k, _ = weight.shape
    rows = weight.detach().permute(1, 2, 3, 0).reshape(cout * k * k, cin, 1, 1)
    codes, scales = quantize_weight(rows, None, ctx.target.layer_weight_range(rows.shape, 1))
    if ctx._may_overflow(node, codes):
        return None
    base = node.name
    w, s = ctx.constant(f"{base}_qweight", codes), ctx.constant(f"{base}_wscale", scales)
    b = ctx.constant(f"{base}_bias", bias.detach().float().repeat_interleave(k * k)) if bias is not None else None
    x = ctx.channels_last_of(source)
    scale, zp, _ = ctx.qparams_of(node)
    out = ctx.call(_ops.conv2d, x.node, x.scale, x.zero_point, w, s, b, [1, 1], [0, 0], [1, 1], 1, scale, zp, "none", None)
    return ctx.output_qvalue(node, ctx.call(F.pixel_shuffle, out, k), channels_last=True)  # pixel_shuffle keeps it
