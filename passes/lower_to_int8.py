"""lower_to_int8: turn a calibrated graph into int8 kernels, by lowering table.

Reads ``node.meta[DECISION]``, ``[OP]``, ``[FUSED_INTO]``, ``[OBSERVER]`` and
``[WEIGHT_OBSERVER]`` plus the observers' statistics. Builds a new graph in which observed values
are ``uint8``/``int8`` tensors with constant scale and zero point. Each quantized op, or fused
group, is looked up by the tuple of its canonical ops (``("conv2d", "add", "relu")``) in the
backend's lowering table, falling back to the generic table. A value is quantized or dequantized
only where a consumer needs the other form, and only once. Ops with no lowering run in float
between a dequantize and a quantize, and are listed in the returned report.

Writes on the new graph's nodes ``[SOURCE]`` (the prepared node whose value each one computes:
for a conv or linear that absorbed a batch norm, ``[FOLDED_BN]``, the batch norm's), ``[PLACEMENT]``
(where that node runs and why, :mod:`lucid_fx.placement`), ``[QPARAMS]`` on every node that
outputs integer codes, and ``[LOWERING]``, ``[OBSERVER_KIND]``, ``[DECISION]`` and ``[INTERVAL]`` on
the node that ends each lowered group, so that the converted graph can be inspected (to_networkx)
and compared with the float one (compare) by node name. Carries ``gm.meta[TRACE]`` over.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.passes.insert_observers import OBSERVERS
from lucid_fx.placement import Placement, Runs
from lucid_fx.passes.lowering_context import (
    ConvertReport,
    LoweringContext,
    QValue,
    _is_observer_call,
    quantize_weight,
)

__all__ = [
    "lower_to_int8", "lowering_table", "predict_placements", "quantize_weight", "QValue", "LoweringContext", "ConvertReport",
]
_LOWERABLE = ("fixed", "statistics", "shared")  # decision kinds convert looks a lowering rule up for


def lowering_table(lowerings: Dict[str, Dict[Tuple[str, ...], Any]], backend: str) -> Dict[Tuple[str, ...], Any]:
    """The rules convert uses on ``backend``: the generic table with the backend's overrides."""
    return {**lowerings.get("generic", {}), **lowerings.get(backend, {})}


def _tag_lowered(ctx: LoweringContext, node: fx.Node, value: QValue, rule_key: str) -> None:
    meta = value.node.meta
    meta[_meta.SOURCE] = node.name
    meta[_meta.LOWERING] = rule_key
    for key in (_meta.OP, _meta.DECISION, _meta.INTERVAL, _meta.INTERVAL_RULE, _meta.MODULE_PATH):
        if key in node.meta:
            meta[key] = node.meta[key]
    observer = ctx.observers[node.meta[_meta.OBSERVER]] if node.meta.get(_meta.OBSERVER) in ctx.observers else None
    if observer is not None:
        meta[_meta.OBSERVER_KIND] = type(observer).__name__


def _tag_new_nodes(graph: fx.Graph, after: Optional[fx.Node], source: fx.Node) -> None:
    """Attribute every node emitted since ``after`` that has no source yet to ``source``."""
    node = after.next if after is not None else next(iter(graph.nodes), None)
    root = graph._root  # the sentinel that closes fx's circular node list
    while node is not None and node is not root:
        node.meta.setdefault(_meta.SOURCE, source.name)
        node = node.next


def _reads_only_shape(node: fx.Node) -> bool:
    """``x.shape``, ``x.size()``, ``x.dim()``: the same answer for codes as for float values."""
    if node.op == "call_function" and getattr(node.target, "__name__", "") == "getattr":
        return len(node.args) > 1 and node.args[1] in ("shape", "ndim")
    return node.op == "call_method" and node.target in ("size", "dim")


def _group(node: fx.Node, graph_nodes: List[fx.Node]) -> List[fx.Node]:
    end = node.meta.get(_meta.FUSED_INTO)
    if end is None:
        return [node]
    return [n for n in graph_nodes if n.meta.get(_meta.FUSED_INTO) == end]


def _names(members: List[fx.Node]) -> Tuple[str, ...]:
    """The prepared nodes a group computes, batch norms folded into its conv or linear included."""
    return tuple(name for m in members for name in (m.name, m.meta.get(_meta.FOLDED_BN)) if name)


def _key(members: List[fx.Node], kind: str, predict: bool = False) -> Tuple[str, ...]:
    if kind == "shared":
        return ("shared",)
    # Predicting on a prepared graph: a batch norm that convert will fold into the conv or linear
    # module before it is no part of the key (conv2d+batch_norm+relu is looked up as conv2d+relu).
    folds = lambda i, m: (  # noqa: E731
        predict and i > 0 and m.op == "call_module" and m.meta[_meta.OP].op == "batch_norm"
        and members[i - 1].op == "call_module" and len(members[i - 1].users) == 1
    )
    return tuple(m.meta[_meta.OP].op for i, m in enumerate(members) if not folds(i, m))


def _stays_float(kind: str, decision: Any, key: Tuple[str, ...], rule: Any, declined: str) -> Placement:
    if kind == "none":
        return Placement(Runs.NOT_TENSOR, decision.reason, ())
    if kind not in _LOWERABLE:  # kept float by the QConfig, a registered float op, or no observer rule
        return Placement(Runs.FLOAT, decision.reason if decision is not None else "no observer decision", ())
    return Placement(Runs.FLOAT, "no lowering rule for " + "+".join(key) if rule is None else declined, ())


def _lowered_runs(value: QValue, key: Tuple[str, ...]) -> Runs:
    """What a rule emitted: a table lookup, the input's codes (as they are or on a rescaled grid), or a kernel."""
    target = value.node.target
    if key == ("shared",) or (value.node.op == "call_method" and target == "view_as"):
        return Runs.SHARED
    return Runs.TABLE if target in (torch.ops.lucid_fx.lut, torch.ops.lucid_fx.lut.default) else Runs.KERNEL


def _predicted_runs(gm: fx.GraphModule, members: List[fx.Node], rule: Any, key: Tuple[str, ...]) -> Runs:
    """The kind ``rule`` will emit, told from the prepared graph (no qparams needed but fixed ones)."""
    from lucid_fx.rules import lowering as rules  # rules import the lowering context, as this pass does

    if key == ("shared",):
        return Runs.SHARED
    if rule is rules.lower_elementwise:
        return Runs.TABLE
    node, call = members[0], members[0].meta[_meta.OP]
    binary = (rules.GENERIC[("add",)], rules.GENERIC[("mul",)], rules.lower_div)
    if len(members) != 1 or rule not in binary or len(call.tensor_inputs()) != 1:
        return Runs.KERNEL
    number = next((v for v in (call.args.get("input"), call.args.get("other")) if not isinstance(v, fx.Node)), None)
    if call.op == "add" or rules._positive_number(number) is None or call.args.get("rounding_mode") is not None:
        return Runs.TABLE  # x + c, or x * c for c <= 0: a table on x's codes
    # x * c, x / c: x's codes on a rescaled grid, unless the output has fixed qparams of its own.
    return Runs.TABLE if node.meta[_meta.DECISION].kind == "fixed" and not _rescale_fits(gm, node, call, number) else Runs.SHARED


def _rescale_fits(gm: fx.GraphModule, node: fx.Node, call: Any, number: float) -> bool:
    observers = getattr(gm, OBSERVERS, {})
    source = call.tensor_inputs()[0]
    source = source.args[0] if _is_observer_call(source) else source
    watched = [observers[n.meta[_meta.OBSERVER]] for n in (source, node) if n.meta.get(_meta.OBSERVER) in observers]
    if len(watched) != 2 or not all(getattr(o, "has_data", True) for o in watched):
        return False  # not calibrated yet: the input's grid is unknown
    (in_scale, in_zp), (out_scale, out_zp) = (tuple(float(v) for v in o.calculate_qparams()) for o in watched)
    scale = in_scale * number if call.op == "mul" else in_scale / number
    return in_zp == out_zp and math.isclose(scale, out_scale, rel_tol=1e-6)


def predict_placements(prepared: fx.GraphModule, table: Dict[Tuple[str, ...], Any]) -> Dict[str, Placement]:
    """Where :func:`lower_to_int8` will run each node of a prepared graph, looked up in ``table`` as
    the pass does, by prepared-node name; a rule may still decline at convert time."""
    nodes = list(prepared.graph.nodes)
    found: Dict[str, Placement] = {}
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output") or _is_observer_call(node) or _meta.OP not in node.meta:
            continue
        decision = node.meta.get(_meta.DECISION)
        kind = decision.kind if decision is not None else "float"
        if kind == "fused":
            continue  # placed with the last node of its group
        members = _group(node, nodes)
        key = _key(members, kind, predict=True)
        rule = table.get(key) if kind in _LOWERABLE else None
        if rule is None:
            placement = _stays_float(kind, decision, key, rule, "")
        else:
            placement = Placement(_predicted_runs(prepared, members, rule, key), "+".join(key), ())
        placement = Placement(placement.runs, placement.why, tuple(m.name for m in members))
        found.update((name, placement) for name in placement.members)
    return found


def _tag_placements(gm: fx.GraphModule, prepared_nodes: List[fx.Node], placed: Dict[str, Placement]) -> None:
    """Every converted node gets the placement of the prepared node it computes; a node computing
    a conv or linear that absorbed a batch norm computes the batch norm's value, so it names that."""
    folded = {n.name: n.meta[_meta.FOLDED_BN] for n in prepared_nodes if _meta.FOLDED_BN in n.meta}
    for node in gm.graph.nodes:
        source = node.meta.get(_meta.SOURCE)
        if source in folded:
            node.meta[_meta.SOURCE] = source = folded[source]
        if source in placed:
            node.meta[_meta.PLACEMENT] = placed[source]


def _copy_float(ctx: LoweringContext, node: fx.Node) -> fx.Node:
    new = ctx.graph.node_copy(node, ctx.float_of)
    ctx.set_float(node, new)
    return new


def lower_to_int8(
    prepared: fx.GraphModule, lowerings: Dict[str, Dict[Tuple[str, ...], Any]], backend: str, weight_range: Tuple[int, int]
) -> Tuple[fx.GraphModule, ConvertReport]:
    """Lower a calibrated (and batch-norm folded) prepared graph; returns the new module and a report."""
    root = prepared  # buffers for packed weights go on the prepared module, which becomes the root
    ctx = LoweringContext(prepared, root, backend, weight_range)
    report = ConvertReport(backend)
    nodes = list(prepared.graph.nodes)
    # Observer calls are aliases of the value they watch.
    alias: Dict[fx.Node, fx.Node] = {}
    for node in nodes:
        if _is_observer_call(node):
            source = node.args[0]
            alias[node] = alias.get(source, source)
    resolve = lambda n: alias.get(n, n) if isinstance(n, fx.Node) else n  # noqa: E731

    def arg_float(n):
        return ctx.float_of(resolve(n))

    def arg_shape(n):
        # Shape queries read the codes already there: no dequantize just to learn a shape.
        n = resolve(n)
        if n not in ctx._float and n in ctx._quant and not ctx._quant[n].channels_last:
            return ctx._quant[n].node
        return ctx.float_of(n)

    table = lowering_table(lowerings, backend)
    for node in nodes:
        if node in alias:
            continue
        if node.op == "placeholder":
            new = ctx.graph.node_copy(node)
            new.meta[_meta.SOURCE] = node.name
            ctx.set_float(node, new)
            continue
        if node.op == "get_attr":
            ctx.set_float(node, ctx.graph.node_copy(node))
            continue
        if node.op == "output":
            ctx.graph.output(fx.node.map_arg(node.args[0], arg_float))
            continue
        decision = node.meta.get(_meta.DECISION)
        kind = decision.kind if decision is not None else "float"
        if kind == "fused":
            continue  # emitted with the last node of its group
        members = _group(node, nodes)
        key = _key(members, kind)
        rule = table.get(key) if kind in _LOWERABLE else None
        lowered = None
        tail = next(iter(reversed(ctx.graph.nodes)), None)
        if rule is not None:
            lowered = rule(ctx, members, resolve)
        if lowered is not None:
            ctx.set_quant(node, lowered)
            _tag_lowered(ctx, node, lowered, "+".join(key))
            _tag_new_nodes(ctx.graph, tail, node)
            placement = Placement(_lowered_runs(lowered, key), "+".join(key), _names(members))
        else:
            # No int8 kernel: the group runs in float on dequantized inputs.
            for member in members:
                read = arg_shape if _reads_only_shape(member) else arg_float
                new = ctx.graph.node_copy(member, lambda n, read=read: read(n))
                new.meta[_meta.SOURCE] = member.name
                ctx.set_float(member, new)
            declined = next((ctx.declined[m.name] for m in members if m.name in ctx.declined), "lowering declined")
            placement = _stays_float(kind, decision, key, rule, declined)
            placement = Placement(placement.runs, placement.why, _names(members))
        report.placements.update((name, placement) for name in placement.members)
    gm = fx.GraphModule(root, ctx.graph, "QuantizedModule")
    _tag_placements(gm, nodes, report.placements)
    if _meta.TRACE in prepared.meta:
        gm.meta[_meta.TRACE] = prepared.meta[_meta.TRACE]
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, report
