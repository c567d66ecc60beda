"""Lowering tables: which int8 kernel each canonical op (or fused group) becomes, per backend.

A table maps the tuple of canonical ops of a node or fused group to a rule
``rule(ctx, members, resolve) -> QValue | None``; ``None`` declines and the group runs in float.
``LOWERINGS["generic"]`` serves every backend; ``LOWERINGS["cuda"]`` (or ``"cpu"``) entries
override it for that backend. The kernels themselves are ``torch.ops.lucid_fx.*``
(``lucid_fx/kernels``), which dispatch on the device of their inputs.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.rules.lowering_context import LoweringContext, QValue
from lucid_fx.rules.lowering_conv import lower_conv, lower_conv_add
from lucid_fx.rules.lowering_conv_transpose import lower_conv_transpose2d
from lucid_fx.rules.lowering_lookup import lower_embedding
from lucid_fx.rules.lowering_norm import lower_batch_norm, lower_group_norm, lower_norm
from lucid_fx.rules.lowering_elementwise import lower_div, lower_elementwise, rescale_by_constant
from lucid_fx.rules.lowering_grouped import lower_grouped_mm
from lucid_fx.rules.lowering_gate import lower_gate_product
from lucid_fx.ops import Tag, canonical, ops_tagged
from lucid_fx.rules.lowering_pool import lower_adaptive_avg_pool1d, lower_avg_pool, lower_stack
from lucid_fx.rules.lowering_attention import lower_masked_softmax, lower_softmax_matmul, unfused_mask
from lucid_fx.rules.observers import FLOAT_BY_DESIGN, DecisionKind, item_source

__all__ = ["LOWERINGS", "ELEMENTWISE_UNARY", "SHAPE_OPS"]

_ops = torch.ops.lucid_fx
Rule = Callable[[LoweringContext, List[fx.Node], Callable], Optional[QValue]]

# Ops that map each element to one element (given their constant arguments): per-tensor int8
# inputs have 256 codes, so the whole op is a 256-entry table.
ELEMENTWISE_UNARY = ops_tagged(Tag.ELEMENTWISE)
# Ops that move or select codes without changing them: they run on the integer tensor as is.
SHAPE_OPS = ops_tagged(Tag.MOVES_CODES)


def _input(call, resolve) -> Any:
    return resolve(call.args.get("input"))


def _post_op(members: List[fx.Node]) -> str:
    call = canonical(members[-1])
    if call.op == "gelu":  # the kernels' names for its two forms
        return "gelu_tanh" if call.args.get("approximate", "none") == "tanh" else "gelu"
    return call.op if call.op in ("relu", "hardswish", "silu") else "none"


def _qin(ctx: LoweringContext, node: Any) -> Optional[QValue]:
    if not isinstance(node, fx.Node) or not ctx.has_quant(node):
        return None
    return ctx.quant_of(node)


def lower_linear(ctx, members, resolve):  # linear(+relu) -> lucid_fx.linear
    call = canonical(members[0])
    x, weight = _qin(ctx, _input(call, resolve)), ctx.quantized_weight(members[0])
    if x is None or weight is None or ctx.qparams_of(members[-1]) is None:
        return None
    w, s, b = weight
    scale, zp, _ = ctx.qparams_of(members[-1])
    out = ctx.call(_ops.linear, x.node, x.scale, x.zero_point, w, s, b, scale, zp, _post_op(members), None)
    return ctx.output_qvalue(members[-1], out)


def _binary(kernel):
    def lower(ctx, members, resolve):  # a (op) b (+relu) on two int8 tensors
        call = canonical(members[0])
        a, b = resolve(call.args.get("input")), resolve(call.args.get("other"))
        rescaled = rescale_by_constant(ctx, members, resolve) if kernel is _ops.mul else None
        if rescaled is not None:  # x * c, c a number or a 0-dim constant
            return rescaled
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            return lower_elementwise(ctx, members, resolve) if len(members) == 1 else None
        qa, qb = _qin(ctx, a), _qin(ctx, b)
        if qa is None or qb is None or call.args.get("alpha", 1) != 1 or ctx.qparams_of(members[-1]) is None:
            return None
        unfused = unfused_mask(ctx.observers, members)  # scores + mask, not fused with its softmax (docs/policies.md)
        if unfused:
            ctx.declined[members[-1].name] = unfused
            return None
        fused = lower_gate_product(ctx, members[0], a, b, qa, qb) if kernel is _ops.mul and len(members) == 1 else None
        if fused is not None:
            return fused  # f(linear(x)) * g(linear(y)): one rounding, of the float product
        scale, zp, _ = ctx.qparams_of(members[-1])
        out = ctx.call(kernel, qa.node, qa.scale, qa.zero_point, qb.node, qb.scale, qb.zero_point, scale, zp, _post_op(members))
        return ctx.output_qvalue(members[-1], out)

    return lower


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
    if item_source(node) is not None:
        return _item_of_codes(ctx, node, resolve)
    tensors = _tensor_inputs(node, resolve)
    if len(tensors) != 1:
        return None
    x = _qin(ctx, tensors[0])
    if x is None:
        return None
    if canonical(node).op in ("max_pool1d", "max_pool2d"):
        pooled = _max_pool(ctx, node, x)
        if pooled is not None or canonical(node).op == "max_pool1d":
            return pooled  # torch has no uint8 max_pool1d: a declined one runs in float
    keeps_layout = canonical(node).op in KEEPS_LAYOUT
    if not keeps_layout:  # views read strides: x.view(n, -1) needs the layout the float model has
        x = ctx.float_layout_of(tensors[0])
    new = MOVERS.get(canonical(node).op, _on_codes)(ctx, node, x, lambda n: resolve(n) is tensors[0], resolve)
    return QValue(new, x.scale, x.zero_point, x.qdtype, x.channels_last and keeps_layout, x.float_layout or not keeps_layout)


def _on_codes(ctx, node: fx.Node, x: QValue, is_input, resolve, codes: Optional[fx.Node] = None) -> fx.Node:
    """``node``'s own call on ``x``'s codes (or on ``codes``): a reshape, a permute, a nearest upsampling, ..."""
    return ctx.graph.node_copy(node, lambda n: (codes or x.node) if is_input(n) else ctx.float_of(resolve(n)))


def _padded(ctx, node, x, is_input, resolve) -> fx.Node:  # F.pad: its zeros are x's zero point (the real 0)
    new = _on_codes(ctx, node, x, is_input, resolve)
    if canonical(node).args.get("mode", "constant") == "constant":
        new.args, new.kwargs = new.args[:3], {**new.kwargs, "value": x.zero_point}
    return new


def _resampled(ctx, node, x, is_input, resolve) -> fx.Node:  # interpolate: nearest moves codes, the rest averages
    if canonical(node).args.get("mode", "nearest") in ("nearest", "nearest-exact"):
        return _on_codes(ctx, node, x, is_input, resolve)
    floats = ctx.graph.call_method("to", (x.node, torch.float32))  # the codes' average, rounded: quantize's codes
    new = _on_codes(ctx, node, x, is_input, resolve, floats)      # of the float result on x's grid
    return ctx.call(_ops.quantize_per_tensor, new, 1.0, 0, x.qdtype.quant_min, x.qdtype.quant_max, x.qdtype.storage)


# Shared ops that keep their input's channels-last layout (no copy to the float model's layout first), and those
# whose call on the codes is not the float op's own: each gives the node computing the moved codes.
KEEPS_LAYOUT = frozenset({"dropout", "identity", "interpolate", "pad"})
MOVERS = {"pad": _padded, "interpolate": _resampled}


def _item_of_codes(ctx, node: fx.Node, resolve) -> Optional[QValue]:
    """chunk(x)[i] -> chunk(codes of x)[i] on x's grid: the item is a view of x's codes (each item
    makes its own chunk call, a view)."""
    source = resolve(item_source(node))
    if _qin(ctx, source) is None:
        return None
    x = ctx.float_layout_of(source)  # chunk reads dims as the float model lays them out
    mover = canonical(node).tensor_inputs()[0]
    moved = ctx.graph.node_copy(mover, lambda n: x.node if resolve(n) is source else ctx.float_of(resolve(n)))
    item = ctx.graph.node_copy(node, lambda n: moved if n is mover else ctx.float_of(resolve(n)))
    return QValue(item, x.scale, x.zero_point, x.qdtype, False, True)


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


def lower_matmul(ctx, members, resolve):  # a @ b on two int8 tensors -> lucid_fx.matmul; softmax(s) @ v -> softmax_matmul
    call = canonical(members[0])
    a, b = _qin(ctx, resolve(call.args.get("input"))), _qin(ctx, resolve(call.args.get("other")))
    if a is None or b is None or ctx.qparams_of(members[-1]) is None:
        return None
    fused = lower_softmax_matmul(ctx, members[0], a, b, resolve(call.args.get("input")))
    if fused is not None:
        return fused
    scale, zp, _ = ctx.qparams_of(members[-1])
    out = ctx.call(_ops.matmul, a.node, a.scale, a.zero_point, b.node, b.scale, b.zero_point, scale, zp)
    return ctx.output_qvalue(members[-1], out)


def lower_softmax(ctx, members, resolve):  # softmax(x, dim) -> lucid_fx.softmax
    call = canonical(members[0])
    x = _qin(ctx, _input(call, resolve))
    dim = call.args.get("dim")
    if x is None or not isinstance(dim, int) or ctx.qparams_of(members[0]) is None:
        return None
    unfused = unfused_mask(ctx.observers, members)  # its input holds a mask not fused with it (docs/policies.md)
    if unfused:
        ctx.declined[members[0].name] = unfused
        return None
    scale, zp, _ = ctx.qparams_of(members[0])
    return ctx.output_qvalue(members[0], ctx.call(_ops.softmax, x.node, x.scale, x.zero_point, dim, scale, zp))


def lower_cat(ctx, members, resolve):  # cat([a, b], dim) -> lucid_fx.cat
    call = canonical(members[0])
    tensors = call.args.get("tensors")
    dim = call.args.get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(dim, int) or ctx.qparams_of(members[0]) is None:
        return None
    values = [_qin(ctx, resolve(t)) for t in tensors]
    if any(v is None for v in values):
        return None
    scale, zp, _ = ctx.qparams_of(members[0])
    out = ctx.call(_ops.cat, [v.node for v in values], [v.scale for v in values], [v.zero_point for v in values], dim, scale, zp)
    return ctx.output_qvalue(members[0], out)


def lower_adaptive_avg_pool2d(ctx, members, resolve):  # adaptive_avg_pool2d -> lucid_fx.adaptive_avg_pool2d
    node = members[0]
    call = canonical(node)
    x = _qin(ctx, _input(call, resolve))
    size = ctx.prepared.get_submodule(node.target).output_size if node.op == "call_module" else call.args.get("output_size")
    if x is None or ctx.qparams_of(node) is None or size is None:
        return None
    size = [size, size] if isinstance(size, int) else list(size)
    if any(s is None for s in size):
        return None
    scale, zp, _ = ctx.qparams_of(node)
    return ctx.output_qvalue(node, ctx.call(_ops.adaptive_avg_pool2d, x.node, x.scale, x.zero_point, size, scale, zp))


def lower_mean(ctx, members, resolve):  # x.mean(dims, keepdim) -> lucid_fx.mean
    node = members[0]
    call = canonical(node)
    x = _qin(ctx, _input(call, resolve))
    dim = call.args.get("dim")
    if x is None or ctx.qparams_of(node) is None or dim is None:
        return None
    dims = [dim] if isinstance(dim, int) else list(dim)
    scale, zp, _ = ctx.qparams_of(node)
    out = ctx.call(_ops.mean, x.node, x.scale, x.zero_point, dims, bool(call.args.get("keepdim", False)), scale, zp)
    return ctx.output_qvalue(node, out)


_CONVS = sorted(ops_tagged(Tag.CONV) - FLOAT_BY_DESIGN.keys())  # conv1d, conv2d
_add, _mul = _binary(_ops.add), _binary(_ops.mul)

GENERIC: Dict[Tuple[str, ...], Rule] = {
    ("linear",): lower_linear,  # linear(x) -> lucid_fx.linear
    ("linear", "relu"): lower_linear,  # relu(linear(x)) -> lucid_fx.linear(post_op="relu")
    **{("linear", a): lower_linear for a in ("hardswish", "silu", "gelu")},  # act(linear(x)) -> lucid_fx.linear(post_op=act)
    **{(c,): lower_conv for c in _CONVS},  # conv(x) -> lucid_fx.conv2d
    ("conv_transpose2d",): lower_conv_transpose2d,  # kernel == stride: a 1x1 lucid_fx.conv2d, then pixel_shuffle
    **{(c, "relu"): lower_conv for c in _CONVS},  # relu(conv(x)) -> lucid_fx.conv2d(post_op="relu")
    **{(c, a): lower_conv for c in _CONVS for a in ("hardswish", "silu")},  # act(conv(x)) -> post_op=act
    ("conv2d", "add"): lower_conv_add,  # conv(x) + y -> lucid_fx.conv2d_add
    ("conv2d", "add", "relu"): lower_conv_add,  # relu(conv(x) + y) -> lucid_fx.conv2d_add(post_op="relu")
    ("add",): _add,  # a + b -> lucid_fx.add; x + c -> table
    ("add", "relu"): _add,  # relu(a + b) -> lucid_fx.add(post_op="relu")
    ("mul",): _mul,  # a * b -> lucid_fx.mul; x * c -> rescaled grid (c > 0) or table
    ("div",): lower_div,  # x / c -> rescaled grid (c > 0) or table
    ("mul", "relu"): _mul,  # relu(a * b) -> lucid_fx.mul(post_op="relu")
    ("matmul",): lower_matmul,  # a @ b -> lucid_fx.matmul
    ("grouped_mm",): lower_grouped_mm,  # experts' rows x their weights -> lucid_fx.grouped_linear
    ("softmax",): lower_softmax,  # softmax(x) -> lucid_fx.softmax
    **{(op, "softmax"): lower_masked_softmax for op in ("masked_fill", "add")},  # softmax(masked s) -> lucid_fx.masked_softmax
    ("cat",): lower_cat,  # cat(xs) -> lucid_fx.cat
    ("adaptive_avg_pool2d",): lower_adaptive_avg_pool2d,  # -> lucid_fx.adaptive_avg_pool2d
    ("adaptive_avg_pool1d",): lower_adaptive_avg_pool1d,  # -> lucid_fx.adaptive_avg_pool2d, 1 high
    **{(op,): lower_avg_pool for op in ("avg_pool1d", "avg_pool2d")},  # -> lucid_fx.avg_pool2d on the codes, requantized
    ("stack",): lower_stack,  # stack(xs, dim) -> lucid_fx.cat of the codes, each unsqueezed
    ("mean",): lower_mean,  # x.mean(dims) -> lucid_fx.mean
    ("embedding",): lower_embedding,  # embedding(ids, W) -> the same lookup in W's codes
    **{(op,): lower_norm for op in ("layer_norm", "rms_norm")},  # -> lucid_fx.layer_norm / rms_norm, float statistics inside
    ("group_norm",): lower_group_norm,  # -> lucid_fx.group_norm, float statistics inside, in the input's layout
    ("batch_norm",): lower_batch_norm,  # a batch norm no conv/linear folds -> lucid_fx.channel_lut, a table per channel
    ("shared",): lower_shared,  # reshape/permute/max_pool/... -> same op on the codes
    **{(op,): lower_elementwise for op in ELEMENTWISE_UNARY if op not in ("add", "mul", "div")},  # f(x) -> lut
}

LOWERINGS: Dict[str, Dict[Tuple[str, ...], Rule]] = {"generic": GENERIC, "cpu": {}, "cuda": {}}
