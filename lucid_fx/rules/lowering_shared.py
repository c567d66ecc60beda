"""Lowering rule for the ops that move or select codes without changing them (reshape, permute, a slice, max
pool, pad, nearest upsampling, ...; the table entry ``("shared",)`` in rules/lowering.py): each runs on the
integer tensor as it is, its output on its input's grid. Most are the node's own call on the codes; the table
:data:`MOVERS` names those whose call differs (a pad's zeros are the zero point; a linear upsampling rounds the
codes' average on the input's grid; a global max pool is the max of the codes), :data:`KEEPS_LAYOUT` those that
keep channels-last codes as they are; :func:`takes` says which it declines (explain asks it too).
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx import _meta
from lucid_fx.ops import canonical
from lucid_fx.rules.lowering_attention import unfused_mask
from lucid_fx.rules.lowering_context import QValue, watched
from lucid_fx.rules.movers import item_source
from lucid_fx.rules.observers import DecisionKind

__all__ = ["lower_shared", "takes", "global_max", "MOVERS", "KEEPS_LAYOUT"]

_ops = torch.ops.lucid_fx


def _tensor_inputs(node: fx.Node, resolve) -> List[fx.Node]:
    """The float-tensor inputs of ``node`` (not the ints of ``x.shape`` that reshape reads)."""
    found = []
    for n in canonical(node).tensor_inputs():
        decision = resolve(n).meta.get(_meta.DECISION)
        if decision is None or decision.kind is not DecisionKind.NONE or resolve(n).op == "placeholder":
            found.append(resolve(n))
    return found


def lower_shared(ctx, members, resolve):  # reshape/permute/max_pool/... run on the codes as they are
    node = members[0]
    unfused = unfused_mask(ctx.observers, members)  # masked scores, read by more than their softmax
    if unfused:
        ctx.declined[node.name] = unfused
        return None
    if item_source(node) is not None:
        return _item_of_codes(ctx, node, resolve)
    tensors = _tensor_inputs(node, resolve)
    if len(tensors) != 1:
        return None
    x = ctx.quant_or_none(tensors[0])
    if x is None:
        return None
    if canonical(node).op in ("max_pool1d", "max_pool2d"):
        pooled = _max_pool(ctx, node, x)
        if pooled is not None or canonical(node).op == "max_pool1d":
            return pooled  # torch has no uint8 max_pool1d: a declined one runs in float
    op = canonical(node).op
    keeps_layout = op in KEEPS_LAYOUT or op in REDUCES_IN_ANY_LAYOUT and not x.channels_last
    if not keeps_layout:  # views read strides: x.view(n, -1) needs the layout the float model has
        x = ctx.float_layout_of(tensors[0])
    new = MOVERS.get(canonical(node).op, _on_codes)(ctx, node, x, lambda n: resolve(n) is tensors[0], resolve)
    if new is None:
        return None
    return QValue(new, x.scale, x.zero_point, x.qdtype, x.channels_last and keeps_layout, x.float_layout or not keeps_layout)


def _on_codes(ctx, node: fx.Node, x: QValue, is_input, resolve, codes: Optional[fx.Node] = None) -> fx.Node:
    """``node``'s own call on ``x``'s codes (or on ``codes``): a reshape, a permute, a nearest upsampling, ..."""
    return ctx.graph.node_copy(node, lambda n: (codes or x.node) if is_input(n) else ctx.float_of(resolve(n)))


def _padded(ctx, node, x, is_input, resolve) -> fx.Node:  # F.pad: its zeros are x's zero point (the real 0)
    args = canonical(node).args
    if node.op == "call_module":  # nn.ReflectionPad2d, nn.ZeroPad2d, ...: F.pad with the module's sizes
        new = ctx.call(F.pad, x.node, args["pad"], args["mode"])
    else:
        new = _on_codes(ctx, node, x, is_input, resolve)
    if args.get("mode", "constant") == "constant":
        new.args, new.kwargs = new.args[:3], {**new.kwargs, "value": x.zero_point}
    return new


def _resampled(ctx, node, x, is_input, resolve) -> fx.Node:  # interpolate: nearest moves codes, the rest averages
    if canonical(node).args.get("mode", "nearest") in ("nearest", "nearest-exact"):
        return _on_codes(ctx, node, x, is_input, resolve)
    floats = ctx.graph.call_method("to", (x.node, torch.float32))  # the codes' average, rounded: quantize's codes
    new = _on_codes(ctx, node, x, is_input, resolve, floats)      # of the float result on x's grid
    return ctx.call(_ops.quantize_per_tensor, new, 1.0, 0, x.qdtype.quant_min, x.qdtype.quant_max, x.qdtype.storage)


def global_max(node: fx.Node) -> bool:
    """An adaptive max pool to one value a channel, or ``F.max_pool1d(x, x.size(-1))`` (a text CNN's max over
    time): the max of the codes over the pooled dims, no indices."""
    call = canonical(node)
    if call.op == "max_pool1d":
        kernel, source = call.args.get("kernel_size"), watched(call.args.get("input"))
        length = canonical(kernel) if isinstance(kernel, fx.Node) and _meta.OP in kernel.meta else None
        ndim = len(getattr(source.meta.get(_meta.TENSOR_META), "shape", ()))
        plain = call.args.get("stride") in (None, kernel) and call.args.get("padding", 0) == 0 and call.args.get("dilation", 1) == 1
        return (length is not None and length.op == "size" and watched(length.args.get("input")) is source
                and length.args.get("dim") in (-1, ndim - 1) and plain and not call.args.get("return_indices"))
    size = call.args.get("output_size")
    sizes = [size] * (1 + (call.op == "adaptive_max_pool2d")) if isinstance(size, int) else list(size or [None])
    return not call.args.get("return_indices") and all(s == 1 for s in sizes)


def takes(node: fx.Node) -> bool:
    """Whether :func:`lower_shared` moves ``node``'s codes: not an adaptive max pool to more than one value a
    channel (windows of unequal widths), a max pool with indices or a computed window other than the whole, or a
    dilated im2col."""
    op = canonical(node).op
    if op in ("adaptive_max_pool1d", "adaptive_max_pool2d"):
        return global_max(node)
    if op == "im2col":
        return _window_sizes(node) is not None
    if op in ("max_pool1d", "max_pool2d"):
        args = canonical(node).args
        computed = any(isinstance(args.get(k), fx.Node) for k in ("kernel_size", "stride", "padding", "dilation"))
        return global_max(node) or not (computed or args.get("return_indices") or len(node.args) > 4)
    return True


def _adaptive_max(ctx, node, x, is_input, resolve) -> Optional[fx.Node]:  # a global max pool: the max of the codes
    if not global_max(node):
        return None  # other output sizes: windows of unequal widths, in float
    return ctx.graph.call_method("amax", (x.node, [-2, -1] if canonical(node).op == "adaptive_max_pool2d" else [-1], True))


def _window_sizes(node: fx.Node):
    """((kh, kw), (ph, pw), (sh, sw)) of an im2col without dilation whose sizes are numbers, else None."""
    args = canonical(node).args
    pair = lambda v: tuple(v) if isinstance(v, (tuple, list)) else (v, v)  # noqa: E731
    sizes = tuple(pair(args.get(k, d)) for k, d in (("kernel_size", None), ("padding", 0), ("stride", 1)))
    ok = pair(args.get("dilation", 1)) == (1, 1) and all(isinstance(v, int) for size in sizes for v in size)
    return sizes if ok else None


def _im2col(ctx, node, x, is_input, resolve) -> Optional[fx.Node]:
    """F.unfold / nn.Unfold (torch has no uint8 im2col): the windows as views of the codes (padded with the zero
    point, the real 0), ``(N, C, oh, ow, kh, kw) -> (N, C * kh * kw, oh * ow)``, as im2col orders them."""
    sizes = _window_sizes(node)
    if sizes is None:
        return None  # dilated windows, or sizes the graph computes: in float
    (kh, kw), (ph, pw), (sh, sw) = sizes
    codes = x.node
    if ph or pw:
        codes = ctx.graph.call_function(F.pad, (codes, [pw, pw, ph, ph]), {"value": float(x.zero_point)})
    method = ctx.graph.call_method
    windows = method("unfold", (method("unfold", (codes, 2, kh, sh)), 3, kw, sw))  # (N, C, oh, ow, kh, kw)
    columns = method("flatten", (method("permute", (windows, 0, 1, 4, 5, 2, 3)), 1, 3))  # (N, C * kh * kw, oh, ow)
    return method("flatten", (columns, 2, 3))


# Shared ops that keep their input's channels-last layout (no copy to the float model's layout first), and those
# whose call on the codes is not the float op's own: each gives the node computing the moved codes (None: declined).
KEEPS_LAYOUT = frozenset({"dropout", "identity", "interpolate", "pad", "adaptive_max_pool2d"})
# Reductions that read dims by index whatever the strides: on codes not flagged channels-last (a Conv1d's (N, C, L)
# in (N, L, C) memory) they run as they are, and only their small result is restored where something reads strides.
REDUCES_IN_ANY_LAYOUT = frozenset({"amax", "amin", "adaptive_max_pool1d"})
MOVERS = {"pad": _padded, "interpolate": _resampled, "im2col": _im2col,
          **dict.fromkeys(("adaptive_max_pool1d", "adaptive_max_pool2d"), _adaptive_max)}


def _item_of_codes(ctx, node: fx.Node, resolve) -> Optional[QValue]:
    """chunk(x)[i] -> chunk(codes of x)[i] on x's grid: the item is a view of x's codes (each item
    makes its own chunk call, a view)."""
    source = resolve(item_source(node))
    if ctx.quant_or_none(source) is None:
        return None
    mover = canonical(node).tensor_inputs()[0]
    # chunk and split keep every dim: their items are views of the codes in the layout they have (a conformer's
    # GLU halves of a channels-last convolution); unbind drops one, so it reads the float model's layout
    x = ctx.quant_of(source) if canonical(mover).op in ("chunk", "split", "tensor_split") else ctx.float_layout_of(source)
    moved = ctx.graph.node_copy(mover, lambda n: x.node if resolve(n) is source else ctx.float_of(resolve(n)))
    item = ctx.graph.node_copy(node, lambda n: moved if n is mover else ctx.float_of(resolve(n)))
    return QValue(item, x.scale, x.zero_point, x.qdtype, x.channels_last, x.float_layout)


def _max_pool(ctx, node: fx.Node, x: QValue) -> Optional[QValue]:
    """max_pool1d/2d on codes -> lucid_fx.max_pool2d (torch's own uint8 max-pool is slow here, and
    its max_pool1d has no uint8 kernel at all): a 1-d pool is a 2-d one over a height of 1."""
    if node.op == "call_module":
        m = ctx.prepared.get_submodule(node.target)
        geometry = (m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode)
        if getattr(m, "return_indices", False):
            return None
    else:
        args = canonical(node).args  # F.max_pool*d passes dilation, ceil_mode, return_indices by keyword
        defaults = (("kernel_size", None), ("stride", None), ("padding", 0), ("dilation", 1), ("ceil_mode", False))
        geometry = tuple(args.get(k, d) for k, d in defaults)
        if args.get("return_indices") or len(node.args) > 4:
            return None
    if global_max(node):  # F.max_pool1d(x, x.size(-1))
        return QValue(ctx.graph.call_method("amax", (x.node, [-1], True)), x.scale, x.zero_point, x.qdtype)
    if any(isinstance(v, fx.Node) for v in geometry):
        return None
    kernel, stride, padding, dilation, ceil_mode = geometry
    if canonical(node).op == "max_pool1d":
        one = lambda v, pad: [pad, v if isinstance(v, int) else v[0]]  # noqa: E731
        codes = ctx.graph.call_method("unsqueeze", (x.node, -2))
        stride = one(stride, 1) if stride else []
        out = ctx.call(_ops.max_pool2d, codes, one(kernel, 1), stride, one(padding, 0), one(dilation, 1), bool(ceil_mode))
        return QValue(ctx.graph.call_method("squeeze", (out, -2)), x.scale, x.zero_point, x.qdtype)
    pair = lambda v: [v, v] if isinstance(v, int) else list(v)  # noqa: E731
    out = ctx.call(_ops.max_pool2d, x.node, pair(kernel), pair(stride) if stride else [], pair(padding), pair(dilation), bool(ceil_mode))
    return QValue(out, x.scale, x.zero_point, x.qdtype, x.channels_last)
