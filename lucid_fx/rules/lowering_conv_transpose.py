"""Lowering rule for a 2-d transposed convolution with one stride s in both dims: a U-Net's 2x2 stride-2
upsampling, a GAN generator's or an FCN decoder's 4x4 stride-2 one with padding 1, an autoencoder's 3x3
stride-2 one with output padding 1, depthwise (grouped) ones.

Output phase (rh, rw) (the output pixels at rh, rw modulo s) sums input pixels times the taps
``W[:, :, m * s + rh, n * s + rw]`` alone: a plain convolution with a (kh / s, kw / s) kernel, flipped. All
s * s phases are one ``lucid_fx.conv2d`` (an int8 kernel) to ``Cout * s * s`` channels,
``W'[(co * s + rh) * s + rw, ci, a, b] = W[ci, co, (kh / s - 1 - a) * s + rh, (kw / s - 1 - b) * s + rw]``
(padded by kh / s - 1, a scale per row of ``W'``, the bias repeated per phase; per group, groups kept),
whose codes ``pixel_shuffle`` interleaves; the padding then crops the border. A kernel that is no multiple
of s is first extended with zero taps to the next multiple (3x3 -> 4x4 at stride 2): the extended
convolution's output is the same with extra positions at the end, which the crop takes off with the
padding (``padding`` from the start, ``padding - output_padding`` plus the extra taps from the end).
With kernel == stride it is a 1x1 convolution and no crop. Dilation, unequal strides and an output
padding past what the crop takes off decline and run in float.
"""

from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx import _meta
from lucid_fx.node_refs import attr_value
from lucid_fx.ops import canonical
from lucid_fx.quantization.weight import quantize_layer_weight
from lucid_fx.rules.lowering_context import QValue
from lucid_fx.rules.lowering_pool import _ints

__all__ = ["lower_conv_transpose2d", "takes"]

_ops = torch.ops.lucid_fx


def _parts(prepared, value_of, node: fx.Node) -> Optional[tuple]:
    """(weight, bias, kernel, stride, padding, output padding, groups, dilation) of a module or F call, the
    functional weight and bias read by ``value_of`` (None where a weight is computed in the graph)."""
    if node.op == "call_module":
        m = prepared.get_submodule(node.target)
        if m.padding_mode != "zeros":
            return None
        return m.weight, m.bias, m.kernel_size, m.stride, m.padding, m.output_padding, m.groups, m.dilation
    args = canonical(node).args
    weight, bias = value_of(args.get("weight")), value_of(args.get("bias"))
    if weight is None or (args.get("bias") is not None and bias is None):
        return None
    get = lambda name, default: _ints(args.get(name, default), 2)  # noqa: E731
    return (weight, bias, tuple(weight.shape[2:]), get("stride", 1), get("padding", 0), get("output_padding", 0),
            args.get("groups", 1), get("dilation", 1))


def _extra_taps(kernel, s: int) -> tuple:
    """The zero taps that extend each kernel dim to a multiple of the stride."""
    return tuple(-k % s for k in kernel)


def _fits(parts: Optional[tuple], source: Any) -> bool:
    """Whether the rule takes this geometry: a batched image, one stride, no dilation, and an output padding
    within what the crop takes off (the padding and the extra taps)."""
    if parts is None or not isinstance(source, fx.Node) or len(getattr(source.meta.get(_meta.TENSOR_META), "shape", ())) != 4:
        return False
    weight, _, kernel, stride, padding, output_padding, groups, dilation = parts
    if None in (stride, padding, output_padding, dilation) or not isinstance(groups, int):
        return False  # sizes computed in the graph
    s = stride[0]
    phases = weight.dim() == 4 and stride[0] == stride[1] and s >= 1 and groups >= 1
    return phases and tuple(dilation) == (1, 1) and all(
        p + extra >= op for p, op, extra in zip(padding, output_padding, _extra_taps(kernel, s)))


def takes(prepared: fx.GraphModule, node: fx.Node) -> bool:
    """Whether :func:`lower_conv_transpose2d` takes ``node`` (a prepared node): explain's prediction."""
    return _fits(_parts(prepared, attr_value, node), canonical(node).args.get("input"))


def lower_conv_transpose2d(ctx, members, resolve) -> Optional[QValue]:
    node = members[0]
    source = resolve(canonical(node).args.get("input"))
    parts = _parts(ctx.prepared, ctx.constant_value, node)
    if not _fits(parts, source) or not ctx.has_quant(source) or ctx.qparams_of(node) is None:
        return None
    weight, bias, kernel, stride, padding, output_padding, groups, dilation = parts
    s, extra = stride[0], _extra_taps(kernel, stride[0])
    weight = F.pad(weight.detach(), (0, extra[1], 0, extra[0]))  # zero taps at the end: the same sums
    cin, per, kh, kw = weight.shape  # per group: cin / groups inputs, per outputs
    taps = weight.reshape(groups, cin // groups, per, kh // s, s, kw // s, s).flip(3, 5)
    rows = taps.permute(0, 2, 4, 6, 1, 3, 5).reshape(groups * per * s * s, cin // groups, kh // s, kw // s)
    codes, scales = quantize_layer_weight(rows, None, ctx.target, groups)
    if ctx._may_overflow(node, codes):
        return None
    base = node.name
    w, sc = ctx.constant(f"{base}_qweight", codes), ctx.constant(f"{base}_wscale", scales)
    b = ctx.constant(f"{base}_bias", bias.detach().float().repeat_interleave(s * s)) if bias is not None else None
    x = ctx.channels_last_of(source)
    scale, zp, _ = ctx.qparams_of(node)
    out = ctx.call(_ops.conv2d, x.node, x.scale, x.zero_point, w, sc, b, [1, 1], [kh // s - 1, kw // s - 1], [1, 1],
                   groups, scale, zp, "none", None)
    out = ctx.call(F.pixel_shuffle, out, s)  # keeps channels-last
    ends = [p - op + e for p, op, e in zip(padding, output_padding, extra)]  # what the crop takes off the end
    if any(padding) or any(ends):
        crop = tuple(slice(p, -end if end else None) for p, end in zip(padding, ends))
        cropped = ctx.call(operator.getitem, out, (slice(None), slice(None), *crop))
        out = ctx.graph.call_method("contiguous", (cropped,), {"memory_format": torch.channels_last})
    return ctx.output_qvalue(node, out, channels_last=True)
