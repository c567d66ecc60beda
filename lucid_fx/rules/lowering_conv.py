"""Lowering rules for convolutions: conv1d/conv2d (+relu) and conv2d + add (+relu).

Part of the lowering table in :mod:`lucid_fx.rules.lowering`; here are the parts only convs need:
channels-last codes, unbatched inputs, and padding modes other than zeros.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, List

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx import _meta
from lucid_fx.rules.lowering_context import QValue
from lucid_fx.computed_weights import parameter_value
from lucid_fx.ops import canonical

__all__ = ["lower_conv", "lower_conv_add", "takes"]

_ops = torch.ops.lucid_fx


def _post_op(members: List[fx.Node]) -> str:
    op = canonical(members[-1]).op
    return op if op in ("relu", "hardswish", "silu") else "none"



def _input(call, resolve) -> Any:
    return resolve(call.args.get("input"))


def _conv_geometry(ctx, node):
    return _geometry(ctx.prepared, ctx.constant_value, node)


def takes(prepared: fx.GraphModule, node: fx.Node) -> bool:
    """Whether the conv rules find this node's geometry (explain's prediction): sizes, not computed in the graph,
    a named padding they can spell as sizes."""
    return _geometry(prepared, parameter_value, node) is not None


def _geometry(prepared, value_of, node):
    """(stride, padding, dilation, groups, padding mode) of a conv module or F.conv call (a functional weight read by
    ``value_of``), or None."""
    if node.op == "call_module":
        m = prepared.get_submodule(node.target)
        stride, padding, dilation, groups, mode, weight = m.stride, m.padding, m.dilation, m.groups, m.padding_mode, m.weight
    else:
        args = canonical(node).args
        stride, padding, dilation, groups = (args.get(k, d) for k, d in (("stride", 1), ("padding", 0), ("dilation", 1), ("groups", 1)))
        mode, weight = "zeros", value_of(args.get("weight"))
    dims = 2 if canonical(node).op == "conv2d" else 1
    as_list = lambda v: [v] * dims if isinstance(v, int) else list(v)  # noqa: E731
    if isinstance(padding, str) and isinstance(weight, torch.Tensor):
        padding = _named_padding(padding, as_list(dilation), weight.shape[2:])
    if isinstance(padding, str) or padding is None or not isinstance(groups, int):
        return None  # uneven "same" padding, or geometry computed in the graph: leave to float
    return as_list(stride), as_list(padding), as_list(dilation), groups, mode


def _named_padding(name: str, dilation: List[int], kernel) -> Any:
    """``padding="valid"`` is none; ``"same"`` (stride 1) pads ``dilation * (k - 1) / 2`` each side where that
    is whole (an odd kernel); None for an uneven one (torch pads the extra row on the far side)."""
    if name == "valid":
        return [0] * len(kernel)
    totals = [d * (k - 1) for d, k in zip(dilation, kernel)]
    return [t // 2 for t in totals] if name == "same" and all(t % 2 == 0 for t in totals) else None


def _conv_input(ctx, node: fx.Node, source: fx.Node, geometry):
    """The codes a conv kernel reads, the geometry to give it, and whether the input is unbatched.

    conv2d reads channels-last codes (what oneDNN computes in). An unbatched input (C, H, W) or
    (C, L), which torch's convs accept, gets a batch dim of 1 for the kernel. Reflect, replicate and
    circular padding (``padding_mode``) pad the codes themselves, which is exact (it only copies
    codes), and the kernel then pads nothing; only ``"zeros"`` padding is the kernel's own."""
    is_2d = canonical(node).op == "conv2d"
    stride, padding, dilation, groups, mode = geometry
    meta = source.meta.get(_meta.TENSOR_META)
    unbatched = meta is not None and len(getattr(meta, "shape", ())) == (3 if is_2d else 2)
    x = ctx.quant_of(source) if unbatched or not is_2d else ctx.channels_last_of(source)
    codes = ctx.graph.call_method("unsqueeze", (x.node, 0)) if unbatched else x.node
    if unbatched and is_2d:
        codes = ctx.graph.call_method("contiguous", (codes,), {"memory_format": torch.channels_last})
    if mode != "zeros" and any(padding):
        pads = [p for p in reversed(padding) for _ in range(2)]  # F.pad: last dim first, both sides
        codes = ctx.call(F.pad, codes, pads, mode)
        if is_2d and mode == "circular":  # torch's circular pad returns NCHW whatever it is given
            codes = ctx.graph.call_method("contiguous", (codes,), {"memory_format": torch.channels_last})
        padding = [0] * len(padding)
    return replace(x, node=codes), (stride, padding, dilation, groups), unbatched


def _conv_output(ctx, members, out: fx.Node, unbatched: bool, is_2d: bool) -> QValue:
    if unbatched:  # back to (C, H, W): its strides are the channels-last batch's, not the float model's
        return replace(ctx.output_qvalue(members[-1], ctx.graph.call_method("squeeze", (out, 0))), float_layout=not is_2d)
    return ctx.output_qvalue(members[-1], out, channels_last=is_2d)


def lower_conv(ctx, members, resolve):  # conv(+relu) -> lucid_fx.conv1d / conv2d
    first = members[0]
    call = canonical(first)
    x, weight = ctx.quant_or_none(_input(call, resolve)), ctx.quantized_weight(first)
    geometry = _conv_geometry(ctx, first)
    if x is None or weight is None or geometry is None or ctx.qparams_of(members[-1]) is None:
        return None
    w, s, b = weight
    scale, zp, _ = ctx.qparams_of(members[-1])
    is_2d = call.op == "conv2d"
    x, geometry, unbatched = _conv_input(ctx, first, _input(call, resolve), geometry)
    if not is_2d:
        return _conv1d_as_2d(ctx, members, x, (w, s, b), geometry, unbatched)
    out = ctx.call(_ops.conv2d, x.node, x.scale, x.zero_point, w, s, b, *geometry, scale, zp, _post_op(members), None)
    return _conv_output(ctx, members, out, unbatched, is_2d)


def _conv1d_as_2d(ctx, members, x: QValue, weight, geometry, unbatched: bool) -> QValue:
    """A 1-d convolution as the 2-d one of height 1 on channels-last codes ((N, C, L) as (N, L, C) in memory):
    the 2-d kernels, their packed weights and program rules (oneDNN's int8 conv1d cost ~100 us a call at
    2x64x50, 0.5x fp32 on a conformer's convolution module; as 2-d twice as fast). A chain of them keeps that
    layout: the next one's input is channels-last already. The result, (N, C, L) with (N, L, C) strides, is
    restored to the float model's layout only where something reads strides."""
    w, s, b = weight
    codes = ctx.attr(w)
    ctx.root.register_buffer(w.target, codes.unsqueeze(2))  # (O, C / g, 1, k): the same codes
    stride, padding, dilation, groups = geometry
    rows = ctx.graph.call_method("unsqueeze", (x.node, 2))
    rows = ctx.graph.call_method("contiguous", (rows,), {"memory_format": torch.channels_last})
    scale, zp, qdtype = ctx.qparams_of(members[-1])
    out = ctx.call(_ops.conv2d, rows, x.scale, x.zero_point, w, s, b, [1, *stride], [0, *padding], [1, *dilation], groups,
                   scale, zp, _post_op(members), None)
    out = ctx.graph.call_method("squeeze", (out, 2))
    if unbatched:
        out = ctx.graph.call_method("squeeze", (out, 0))
    return QValue(out, scale, zp, qdtype, False, False)


def lower_conv_add(ctx, members, resolve):  # conv + y (+relu) -> lucid_fx.conv2d_add
    conv, add = members[0], members[1]
    other_node = next((resolve(a) for a in canonical(add).tensor_inputs() if resolve(a) is not conv), None)
    x, other = ctx.quant_or_none(_input(canonical(conv), resolve)), ctx.quant_or_none(other_node)
    weight = ctx.quantized_weight(conv)
    geometry = _conv_geometry(ctx, conv)
    if None in (x, other, weight, geometry) or canonical(conv).op != "conv2d" or ctx.qparams_of(members[-1]) is None:
        return None
    w, s, b = weight
    scale, zp, _ = ctx.qparams_of(members[-1])
    x, geometry, unbatched = _conv_input(ctx, conv, _input(canonical(conv), resolve), geometry)
    other_codes = ctx.graph.call_method("unsqueeze", (other.node, 0)) if unbatched else other.node
    out = ctx.call(
        _ops.conv2d_add, x.node, x.scale, x.zero_point, w, s, b, *geometry,
        other_codes, other.scale, other.zero_point, scale, zp, _post_op(members), None,
    )
    return _conv_output(ctx, members, out, unbatched, True)
