"""Lowering rules for ops that map each code to one code: a 256-entry table (``lucid_fx.lut``) for any
elementwise op of one int8 input, a table per channel (``lucid_fx.channel_lut``) for a PReLU with a slope per
channel, and the free rescale of ``x * c`` / ``x / c`` (same codes, grid
scaled by ``c``). Entries in :data:`lucid_fx.rules.lowering.LOWERINGS`."""

from __future__ import annotations

import math
from typing import Any, Optional

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.ops import canonical
from lucid_fx.kernels import make_lut
from lucid_fx.kernels.channel_lut import prelu_tables
from lucid_fx.quantization.observers import FixedQParamsObserver
from lucid_fx.rules.lowering_context import QValue
from lucid_fx.rules.lowering_gate import lower_gate
from lucid_fx.node_refs import scalar_constant
from lucid_fx.rules.one_source import TABLE_WHY, TWO_VALUES_WHY, evaluate, one_source, two_values
from lucid_fx._placement import Runs

__all__ = ["lower_elementwise", "lower_extremum", "lower_prelu", "lower_div", "rescale_by_constant"]

_ops = torch.ops.lucid_fx


def _positive_number(value: Any) -> Optional[float]:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf
    return float(value) if ok else None


def _positive_constant(value: Any) -> Optional[float]:
    return _positive_number(scalar_constant(value))


def _fixed_grid_differs(ctx, node: fx.Node, scale: float, zero_point: int) -> bool:
    observer = ctx.observers[node.meta[_meta.OBSERVER]] if node.meta.get(_meta.OBSERVER) in ctx.observers else None
    observer = getattr(observer, "activation_post_process", observer)  # a FakeQuantize's observer
    if not isinstance(observer, FixedQParamsObserver):
        return False
    fixed_scale, fixed_zp, _ = ctx.qparams_of(node)
    return fixed_zp != zero_point or not math.isclose(fixed_scale, scale, rel_tol=1e-6)


def rescale_by_constant(ctx, members, resolve) -> Optional[QValue]:
    """``x * c`` or ``x / c`` for a number ``c > 0`` (or a 0-dim constant holding one) on int8 ``x``: the
    same codes on the grid ``(scale * c, zero_point)``. No arithmetic and no rounding (attention's ``*
    d**-0.5`` costs nothing); the op's own observer is not used. None for anything else."""
    if len(members) != 1:
        return None
    call = canonical(members[0])
    a, b = resolve(call.args.get("input")), resolve(call.args.get("other"))
    if call.op == "mul" and _positive_constant(a) is not None:
        a, b = b, a
    factor = _positive_constant(b)
    if call.op == "div" and (call.args.get("rounding_mode") is not None or factor is None):
        return None
    x = ctx.quant_or_none(a)
    if x is None or factor is None:
        return None
    scale = x.scale * factor if call.op == "mul" else x.scale / factor
    if _fixed_grid_differs(ctx, members[0], scale, x.zero_point):
        return None  # a range-bounded op keeps the grid its FixedQParamsObserver promises
    same_codes = ctx.graph.call_method("view_as", (x.node, x.node))
    return QValue(same_codes, scale, x.zero_point, x.qdtype, x.channels_last)


def lower_div(ctx, members, resolve):  # x / c -> the codes of x on a rescaled grid; else -> table
    return rescale_by_constant(ctx, members, resolve) or lower_elementwise(ctx, members, resolve)


def lower_elementwise(ctx, members, resolve):  # f(x), or any elementwise graph of one int8 x -> 256-entry table
    node = members[0]
    tensors = [resolve(n) for n in canonical(node).tensor_inputs()]
    found = one_source(members) if len(members) == 1 and ctx.qparams_of(node) is not None else None
    x = ctx.quant_or_none(found[0]) if found is not None else None
    if x is None:
        if found is None and len(members) == 1 and two_values(node) and ctx.qparams_of(node) is not None:
            ctx.declined[node.name] = TWO_VALUES_WHY  # a / b
        return None
    gate = lower_gate(ctx, node, tensors[0], x) if len(tensors) == 1 and not found[1] else None
    if gate is not None:  # tanh/sigmoid(linear(h)): the linear's post-op
        return gate
    scale, zp, qdtype = ctx.qparams_of(node)
    codes = torch.arange(x.qdtype.quant_min, x.qdtype.quant_max + 1, dtype=torch.float32)
    mapped = evaluate(ctx.prepared, found[0], found[1] + [node], (codes - x.zero_point) * x.scale)
    if mapped is None:
        return None
    in_range, out_range = (x.qdtype.quant_min, x.qdtype.quant_max), (qdtype.quant_min, qdtype.quant_max)
    table = make_lut(lambda values: mapped, x.scale, x.zero_point, in_range, scale, zp, out_range)
    out = ctx.call(_ops.lut, x.node, ctx.constant(f"{node.name}_lut", table))
    for inner in found[1]:  # computed in this table: their own lookups, if emitted, are dead now
        ctx.absorb(inner.name, node, TABLE_WHY.format(end=node.name, source=found[0].name), Runs.TABLE)
    return ctx.output_qvalue(node, out)


def lower_extremum(ctx, members, resolve):  # maximum(a, b) / minimum(a, b) of two int8 values (Max-Feature-Map)
    """One table where both come from one value (``torch.maximum(x, 0.2 * x)``). Else rounding keeps order, so
    the rounded max (min) of the values is the max of the codes on one grid: on a grid they share (the halves
    of one convolution, LightCNN's Max-Feature-Map), the max of their codes as they lie, then one table onto
    the output's grid; on two, each onto the output's grid by a table, then the max."""
    table = lower_elementwise(ctx, members, resolve)
    node, call = members[0], canonical(members[0])
    if table is not None or len(members) != 1 or ctx.qparams_of(node) is None:
        return table
    sources = [resolve(call.args.get(name)) for name in ("input", "other")]
    if not all(isinstance(n, fx.Node) and ctx.quant_or_none(n) is not None for n in sources):
        return None
    a, b = (ctx.quant_of(n) for n in sources)
    shapes = {tuple(getattr(n.meta.get(_meta.TENSOR_META), "shape", ())) for n in sources}
    if a.channels_last != b.channels_last or len(shapes) != 1:  # they broadcast: in the float model's layout
        a, b = (ctx.float_layout_of(n) for n in sources)
    scale, zp, qdtype = ctx.qparams_of(node)
    pick = torch.maximum if call.op == "maximum" else torch.minimum

    def onto(x, codes, name):  # codes on x's grid -> the output's
        table = make_lut(lambda v: v, x.scale, x.zero_point, (x.qdtype.quant_min, x.qdtype.quant_max), scale, zp,
                         (qdtype.quant_min, qdtype.quant_max))
        return ctx.call(_ops.lut, codes, ctx.constant(f"{node.name}_{name}", table))

    if (a.scale, a.zero_point, a.qdtype) == (b.scale, b.zero_point, b.qdtype):
        out = onto(a, ctx.call(pick, a.node, b.node), "onto")
    else:
        out = ctx.call(pick, onto(a, a.node, "onto_0"), onto(b, b.node, "onto_1"))
    return QValue(out, scale, zp, qdtype, a.channels_last, a.float_layout)


def lower_prelu(ctx, members, resolve):  # prelu(x, a): one slope -> a lut; a slope per channel -> lucid_fx.channel_lut
    node = members[0]
    call = canonical(node)
    weight = ctx.prepared.get_submodule(node.target).weight if node.op == "call_module" else ctx.constant_value(call.args.get("weight"))
    if weight is not None and weight.numel() == 1:
        return lower_elementwise(ctx, members, resolve)
    source = resolve(call.args.get("input"))
    x, shape = ctx.quant_or_none(source), tuple(getattr(source.meta.get(_meta.TENSOR_META), "shape", ()))
    if len(members) != 1 or x is None or weight is None or ctx.qparams_of(node) is None or len(shape) < 2 or weight.numel() != shape[1]:
        return None
    scale, zp, qdtype = ctx.qparams_of(node)
    tables = prelu_tables(weight, x.scale, x.zero_point, (x.qdtype.quant_min, x.qdtype.quant_max), scale, zp,
                          (qdtype.quant_min, qdtype.quant_max), qdtype.storage)
    out = ctx.call(_ops.channel_lut, x.node, ctx.constant(f"{node.name}_tables", tables), 1)
    return QValue(out, scale, zp, qdtype, x.channels_last)  # each code looked up where it lies: x's layout
