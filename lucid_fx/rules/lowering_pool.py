"""Lowering rules for average pools and stack (the table entries are in rules/lowering.py).

``avg_pool2d`` runs as ``lucid_fx.avg_pool2d``: one pass over the codes that averages them and
requantizes onto the output's grid. A 1-d pool is the 2-d one over a height of 1, as for
max_pool1d; ``adaptive_avg_pool1d`` likewise runs as ``lucid_fx.adaptive_avg_pool2d``. ``stack``
is ``lucid_fx.cat`` of its inputs' codes, each with the new dim added.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch import fx

from lucid_fx.ops import canonical

__all__ = ["lower_avg_pool", "lower_adaptive_avg_pool1d", "lower_stack"]

_ops = torch.ops.lucid_fx
_AVG_DEFAULTS = (("kernel_size", None), ("stride", None), ("padding", 0), ("ceil_mode", False), ("count_include_pad", True))



def _ints(value: Any, dims: int) -> Optional[List[int]]:
    """``value`` (an int, or a tuple of ``dims`` ints) as a list of ``dims`` ints, else None."""
    items = [value] * dims if isinstance(value, int) else list(value) if isinstance(value, (list, tuple)) else None
    ok = items is not None and len(items) == dims and all(isinstance(v, int) and not isinstance(v, bool) for v in items)
    return items if ok else None


def _avg_geometry(ctx, node: fx.Node, dims: int) -> Optional[Tuple[List[int], List[int], List[int], bool, bool]]:
    """(kernel, stride, padding, ceil_mode, count_include_pad) of an avg-pool module or call, each
    size a list of ``dims`` ints (an empty stride: the kernel's); None for what the kernel does not
    take (a divisor_override, sizes computed in the graph)."""
    if node.op == "call_module":
        m = ctx.prepared.get_submodule(node.target)
        values = (m.kernel_size, m.stride, m.padding, m.ceil_mode, m.count_include_pad)
        divisor = getattr(m, "divisor_override", None)
    else:
        args = canonical(node).args
        values = tuple(args.get(k, d) for k, d in _AVG_DEFAULTS)
        divisor = args.get("divisor_override")
    kernel, stride, padding, ceil_mode, include_pad = values
    stride = [] if stride is None or stride == () or stride == [] else _ints(stride, dims)
    kernel, padding = _ints(kernel, dims), _ints(padding, dims)
    if divisor is not None or kernel is None or stride is None or padding is None:
        return None
    if not (isinstance(ceil_mode, bool) and isinstance(include_pad, bool)):
        return None
    return kernel, stride, padding, ceil_mode, include_pad


def lower_avg_pool(ctx, members, resolve):  # avg_pool1d/2d -> lucid_fx.avg_pool2d on the codes, requantized
    node = members[0]
    call = canonical(node)
    one_d = call.op == "avg_pool1d"
    x = ctx.quant_or_none(resolve(call.args.get("input")))
    geometry = _avg_geometry(ctx, node, 1 if one_d else 2)
    if x is None or geometry is None or ctx.qparams_of(node) is None:
        return None
    kernel, stride, padding, ceil_mode, include_pad = geometry
    scale, zp, _ = ctx.qparams_of(node)
    if one_d:  # (N, C, L) -> (N, C, 1, L): the pool's window is 1 high
        codes = ctx.graph.call_method("unsqueeze", (x.node, -2))
        stride = [1, *stride] if stride else []
        out = ctx.call(_ops.avg_pool2d, codes, x.scale, x.zero_point, [1, *kernel], stride, [0, *padding], ceil_mode,
                       include_pad, scale, zp)
        return ctx.output_qvalue(node, ctx.graph.call_method("squeeze", (out, -2)))
    out = ctx.call(_ops.avg_pool2d, x.node, x.scale, x.zero_point, kernel, stride, padding, ceil_mode, include_pad, scale, zp)
    return ctx.output_qvalue(node, out, channels_last=x.channels_last)


def lower_adaptive_avg_pool1d(ctx, members, resolve):  # adaptive_avg_pool1d -> lucid_fx.adaptive_avg_pool2d, 1 high
    node = members[0]
    call = canonical(node)
    x = ctx.quant_or_none(resolve(call.args.get("input")))
    size = ctx.prepared.get_submodule(node.target).output_size if node.op == "call_module" else call.args.get("output_size")
    size = _ints(size, 1)
    if x is None or size is None or ctx.qparams_of(node) is None:
        return None
    scale, zp, _ = ctx.qparams_of(node)
    codes = ctx.graph.call_method("unsqueeze", (x.node, -2))
    out = ctx.call(_ops.adaptive_avg_pool2d, codes, x.scale, x.zero_point, [1, *size], scale, zp)
    return ctx.output_qvalue(node, ctx.graph.call_method("squeeze", (out, -2)))


def lower_stack(ctx, members, resolve):  # stack(xs, dim) -> lucid_fx.cat of each x's codes unsqueezed at dim
    node = members[0]
    call = canonical(node)
    tensors, dim = call.args.get("tensors"), call.args.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int) or ctx.qparams_of(node) is None:
        return None
    sources = [resolve(t) for t in tensors]
    if not all(ctx.quant_or_none(s) is not None for s in sources):
        return None
    values = [ctx.float_layout_of(s) for s in sources]  # unsqueeze reads strides: the float model's layout
    parts = [ctx.graph.call_method("unsqueeze", (v.node, dim)) for v in values]
    scale, zp, _ = ctx.qparams_of(node)
    out = ctx.call(_ops.cat, parts, [v.scale for v in values], [v.zero_point for v in values], dim, scale, zp)
    return ctx.output_qvalue(node, out)
