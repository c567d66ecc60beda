"""Lowering tables: which int8 kernel each canonical op (or fused group) becomes, per backend.

A table maps the tuple of canonical ops of a node or fused group to a rule
``rule(ctx, members, resolve) -> QValue | None``; ``None`` declines and the group runs in float.
``LOWERINGS["generic"]`` serves every backend; ``LOWERINGS["cuda"]`` (or ``"cpu"``) entries
override it for that backend. The kernels themselves are ``torch.ops.lucid_fx.*``
(``lucid_fx/kernels``), which dispatch on the device of their inputs.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.rules.lowering_context import LoweringContext, QValue
from lucid_fx.rules.lowering_conv import lower_conv, lower_conv_add
from lucid_fx.rules.lowering_conv_transpose import lower_conv_transpose2d
from lucid_fx.rules.lowering_lookup import lower_embedding
from lucid_fx.rules.lowering_norm import lower_batch_norm, lower_group_norm, lower_norm, lower_normalize
from lucid_fx.rules.lowering_elementwise import lower_div, lower_elementwise, lower_extremum, lower_prelu, rescale_by_constant
from lucid_fx.rules.lowering_grouped import lower_grouped_mm
from lucid_fx.rules.lowering_gate import lower_gate_product
from lucid_fx.ops import Tag, canonical, ops_tagged
from lucid_fx.rules.lowering_pool import lower_adaptive_avg_pool1d, lower_avg_pool, lower_stack
from lucid_fx.rules.lowering_shared import lower_shared
from lucid_fx.rules.lowering_attention import lower_masked_softmax, lower_softmax_matmul, unfused_mask
from lucid_fx.rules.float_policies import FLOAT_BY_DESIGN

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


def lower_linear(ctx, members, resolve):  # linear(+relu) -> lucid_fx.linear
    call = canonical(members[0])
    x, weight = ctx.quant_or_none(_input(call, resolve)), ctx.quantized_weight(members[0])
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
        qa, qb = ctx.quant_or_none(a), ctx.quant_or_none(b)  # None for a number
        if qa is None or qb is None or call.args.get("alpha", 1) != 1 or ctx.qparams_of(members[-1]) is None:
            return lower_elementwise(ctx, members, resolve) if len(members) == 1 else None  # x + c, x * (x > 0): a table of x
        unfused = unfused_mask(ctx.observers, members)  # scores + mask, not fused with its softmax (docs/policies.md)
        if unfused:
            ctx.declined[members[-1].name] = unfused
            return None
        fused = lower_gate_product(ctx, members[0], a, b, qa, qb) if kernel is _ops.mul and len(members) == 1 else None
        if fused is not None:
            return fused  # f(linear(x)) * g(linear(y)): one rounding, of the float product
        table = lower_elementwise(ctx, members, resolve) if len(members) == 1 else None
        if table is not None:
            return table  # both computed elementwise from one value (x * sigmoid(x)): one table of its codes
        scale, zp, _ = ctx.qparams_of(members[-1])
        out = ctx.call(kernel, qa.node, qa.scale, qa.zero_point, qb.node, qb.scale, qb.zero_point, scale, zp, _post_op(members))
        return ctx.output_qvalue(members[-1], out)

    return lower


def lower_matmul(ctx, members, resolve):  # a @ b on two int8 tensors -> lucid_fx.matmul; softmax(s) @ v -> softmax_matmul
    call = canonical(members[0])
    a, b = ctx.quant_or_none(resolve(call.args.get("input"))), ctx.quant_or_none(resolve(call.args.get("other")))
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
    x = ctx.quant_or_none(_input(call, resolve))
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
    values = [ctx.quant_or_none(resolve(t)) for t in tensors]
    if any(v is None for v in values):
        return None
    scale, zp, _ = ctx.qparams_of(members[0])
    out = ctx.call(_ops.cat, [v.node for v in values], [v.scale for v in values], [v.zero_point for v in values], dim, scale, zp)
    return ctx.output_qvalue(members[0], out)


def lower_adaptive_avg_pool2d(ctx, members, resolve):  # adaptive_avg_pool2d -> lucid_fx.adaptive_avg_pool2d
    node = members[0]
    call = canonical(node)
    x = ctx.quant_or_none(_input(call, resolve))
    size = ctx.prepared.get_submodule(node.target).output_size if node.op == "call_module" else call.args.get("output_size")
    if x is None or ctx.qparams_of(node) is None or size is None:
        return None
    size = [size, size] if isinstance(size, int) else list(size)
    if any(s is None for s in size):
        return None
    scale, zp, _ = ctx.qparams_of(node)
    return ctx.output_qvalue(node, ctx.call(_ops.adaptive_avg_pool2d, x.node, x.scale, x.zero_point, size, scale, zp))


def _reduced(source: Any, dim: Any) -> Tuple[Optional[List[int]], Optional[Tuple[int, ...]]]:
    """(the dims a mean or sum reduces, its input's shape): ``x.mean()`` (no dim) reduces every dim of a
    known shape; (None, None) where that shape is not known."""
    shape = getattr(source.meta.get(_meta.TENSOR_META), "shape", None) if isinstance(source, fx.Node) else None
    if dim is None or (isinstance(dim, (list, tuple)) and not dim):  # x.sum(dim=[]) reduces every dim too, as torch does
        return (list(range(len(shape))), tuple(shape)) if shape is not None else (None, None)
    return ([dim] if isinstance(dim, int) else list(dim)), (tuple(shape) if shape is not None else None)


def lower_mean(ctx, members, resolve):  # x.mean(dims, keepdim) -> lucid_fx.mean
    node = members[0]
    call = canonical(node)
    source = _input(call, resolve)
    x, (dims, _) = ctx.quant_or_none(source), _reduced(source, call.args.get("dim"))
    if x is None or ctx.qparams_of(node) is None or dims is None:
        return None
    scale, zp, _ = ctx.qparams_of(node)
    out = ctx.call(_ops.mean, x.node, x.scale, x.zero_point, dims, bool(call.args.get("keepdim", False)), scale, zp)
    return ctx.output_qvalue(node, out)


SUM_OF_PRODUCTS_WHY = ("a sum of products of two values (attention pooling's (w * h).sum(1)) runs in float: int8 would round "
                       "each product before the sum (measured 28.9 dB against 39.7)")


def sums_products(node: fx.Node) -> bool:
    """Whether ``node`` sums a product of two tensors (each product would be rounded before the sum)."""
    source = canonical(node).args.get("input")
    return isinstance(source, fx.Node) and _meta.OP in source.meta and canonical(source).op == "mul" \
        and len(canonical(source).tensor_inputs()) == 2


def lower_sum(ctx, members, resolve):  # x.sum(dims) -> lucid_fx.mean on a grid N times finer: the sum is N means
    node = members[0]
    call = canonical(node)
    if sums_products(node):
        ctx.declined[node.name] = SUM_OF_PRODUCTS_WHY
        return None
    source = _input(call, resolve)
    x, (dims, shape) = ctx.quant_or_none(source), _reduced(source, call.args.get("dim"))
    if x is None or ctx.qparams_of(node) is None or shape is None or call.args.get("dtype") is not None:
        return None
    count = math.prod(shape[d] for d in dims)
    scale, zp, _ = ctx.qparams_of(node)  # quantize(mean, scale / N) = quantize(sum, scale)
    out = ctx.call(_ops.mean, x.node, x.scale, x.zero_point, dims, bool(call.args.get("keepdim", False)), scale / count, zp)
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
    ("sum",): lower_sum,  # x.sum(dims) -> lucid_fx.mean, its output grid N times finer
    ("embedding",): lower_embedding,  # embedding(ids, W) -> the same lookup in W's codes
    **{(op,): lower_norm for op in ("layer_norm", "rms_norm")},  # -> lucid_fx.layer_norm / rms_norm, float statistics inside
    ("normalize",): lower_normalize,  # F.normalize(x, dim=-1) -> lucid_fx.rms_norm of weight 1 / sqrt(d)
    **{(op,): lower_group_norm for op in ("group_norm", "instance_norm")},  # -> lucid_fx.group_norm, in the input's layout
    ("prelu",): lower_prelu,  # one slope -> lut; a slope per channel -> lucid_fx.channel_lut, a table per channel
    ("batch_norm",): lower_batch_norm,  # a batch norm no conv/linear folds -> lucid_fx.channel_lut, a table per channel
    ("shared",): lower_shared,  # reshape/permute/max_pool/... -> same op on the codes
    **{(op,): lower_elementwise for op in ELEMENTWISE_UNARY if op not in ("add", "mul", "div", "maximum", "minimum")},  # f(x) -> lut
    **{(op,): lower_extremum for op in ("maximum", "minimum")},  # of one value -> lut; of two -> each onto the grid, max of codes
}

LOWERINGS: Dict[str, Dict[Tuple[str, ...], Rule]] = {"generic": GENERIC, "cpu": {}, "cuda": {}}
