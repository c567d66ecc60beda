"""lower_to_int8: turn a calibrated graph into int8 kernels, by lowering table.

Reads ``node.meta[DECISION]``, ``[OP]``, ``[FUSED_INTO]``, ``[OBSERVER]``,
``[WEIGHT_OBSERVER]``, ``[MUTATION]`` (an op kept in place runs as written, in float, and is never
dropped as dead code), ``[BN_NOT_FOLDED]`` and ``["tensor_meta"]`` (the float model's layout, which
every value leaving int8 gets back) plus the observers' statistics. Builds a new graph in which observed values
are ``uint8``/``int8`` tensors with constant scale and zero point. Each quantized op, or fused
group, is looked up by the tuple of its canonical ops (``("conv2d", "add", "relu")``) in the
backend's lowering table, falling back to the generic table. A value is quantized or dequantized
only where a consumer needs the other form, and only once. Ops with no lowering run in float
between a dequantize and a quantize, and are listed in the returned report.

Writes on the new graph's nodes ``[SOURCE]`` (the prepared node whose value each one computes:
for a conv or linear that absorbed a batch norm, ``[FOLDED_BN]``, the batch norm's), ``[PLACEMENT]``
(where that node runs and why, :mod:`lucid_fx.placement`), ``[ABSORBED]`` (the placements of prepared nodes
its kernel or table computes inside, which have no node of their own), ``[QPARAMS]`` on every node that
outputs integer codes, and ``[LOWERING]``, ``[OBSERVER_KIND]``, ``[DECISION]`` and ``[INTERVAL]`` on
the node that ends each lowered group, so that the converted graph can be inspected (to_networkx)
and compared with the float one (compare) by node name. Carries ``gm.meta[TRACE]`` over.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.ops import canonical
from lucid_fx._placement import ConvertReport, Placement, Runs
from lucid_fx.kernels.target import Target
from lucid_fx.passes.fold_signature_constants import GUARDS
from lucid_fx.rules.lowering_context import (
    LoweringContext,
    QValue,
    _is_observer_call,
)
from lucid_fx.rules.observers import DecisionKind

__all__ = ["lower_to_int8", "lowering_table"]
_LOWERABLE = (DecisionKind.FIXED, DecisionKind.STATISTICS, DecisionKind.SHARED)  # decision kinds convert looks a lowering rule up for


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


def _inputs_in_float_layout(ctx: LoweringContext, members: List[fx.Node], resolve) -> bool:
    """Whether every int8 input of a lowered group is laid out as in the float model: kernels keep
    their input's layout (an elementwise table on channels-last codes gives channels-last codes)."""
    for member in members:
        for source in canonical(member).tensor_inputs():
            q = ctx._quant.get(resolve(source))
            if q is not None and resolve(source) not in members and q.float_layout is False:
                return False
    return True


def _keeps_effect(node: fx.Node) -> bool:
    """Dead-code elimination keeps an in-place op left in place (its change is the point) and torch.fx's guards."""
    return node.is_impure() or _meta.MUTATION in node.meta or node.target in GUARDS


def _group(node: fx.Node, graph_nodes: List[fx.Node]) -> List[fx.Node]:
    end = node.meta.get(_meta.FUSED_INTO)
    if end is None:
        return [node]
    return [n for n in graph_nodes if n.meta.get(_meta.FUSED_INTO) == end]


def _names(members: List[fx.Node]) -> Tuple[str, ...]:
    """The prepared nodes a group computes, batch norms folded into its conv or linear included."""
    return tuple(name for m in members for name in (m.name, m.meta.get(_meta.FOLDED_BN)) if name)


def _key(members: List[fx.Node], kind: DecisionKind) -> Tuple[str, ...]:
    return ("shared",) if kind is DecisionKind.SHARED else tuple(canonical(m).op for m in members)


def lowerable(node: fx.Node, kind: DecisionKind) -> bool:
    """Whether a lowering rule may take ``node``: its decision quantizes it, the user did not keep the op
    float (its output may still be observed, as a quantized op's input), and it is not kept in place."""
    decision = node.meta.get(_meta.DECISION)
    return kind in _LOWERABLE and not getattr(decision, "keep_float", False) and _meta.MUTATION not in node.meta


def _stays_float(kind: DecisionKind, decision: Any, key: Tuple[str, ...], rule: Any, declined: str) -> Placement:
    if kind is DecisionKind.NONE:
        return Placement(Runs.NOT_TENSOR, decision.reason, ())
    if kind not in _LOWERABLE or getattr(decision, "keep_float", False):  # kept float by the QConfig, the registry or no rule
        return Placement(Runs.FLOAT, decision.reason if decision is not None else "no observer decision", ())
    return Placement(Runs.FLOAT, "no lowering rule for " + "+".join(key) if rule is None else declined, ())


def _lowered_runs(value: QValue, key: Tuple[str, ...]) -> Runs:
    """What a rule emitted: a table lookup, the input's codes (as they are or on a rescaled grid), or a kernel."""
    target = value.node.target
    if key == ("shared",) or (value.node.op == "call_method" and target == "view_as"):
        return Runs.SHARED
    return Runs.TABLE if target in (torch.ops.lucid_fx.lut, torch.ops.lucid_fx.lut.default) else Runs.KERNEL


def _tag_placements(gm: fx.GraphModule, prepared_nodes: List[fx.Node], placed: Dict[str, Placement],
                    absorbed: Dict[str, Tuple[str, Placement]]) -> None:
    """Every converted node gets the placement of the prepared node it computes, and those of the prepared
    nodes its kernel computes inside (``ABSORBED``); a node computing a conv or linear that absorbed a batch
    norm computes the batch norm's value, so it names that."""
    folded = {n.name: n.meta[_meta.FOLDED_BN] for n in prepared_nodes if _meta.FOLDED_BN in n.meta}
    inside: Dict[str, Dict[str, Placement]] = {}
    for name, (by, placement) in absorbed.items():
        if name != by:
            inside.setdefault(by, {})[name] = placement
    for node in gm.graph.nodes:
        source = node.meta.get(_meta.SOURCE)
        if source in folded:
            node.meta[_meta.SOURCE] = source = folded[source]
        if source in placed:
            node.meta[_meta.PLACEMENT] = placed[source]
        if source in inside:
            node.meta[_meta.ABSORBED] = inside[source]


def _copy_float(ctx: LoweringContext, node: fx.Node) -> fx.Node:
    new = ctx.graph.node_copy(node, ctx.float_of)
    ctx.set_float(node, new)
    return new


def lower_to_int8(
    prepared: fx.GraphModule, lowerings: Dict[str, Dict[Tuple[str, ...], Any]], target: Target
) -> Tuple[fx.GraphModule, ConvertReport]:
    """Lower a calibrated (and batch-norm folded) prepared graph for ``target`` (its backend's
    lowering table, its weight grid); returns the new module and a report."""
    root = prepared  # buffers for packed weights go on the prepared module, which becomes the root
    ctx = LoweringContext(prepared, root, target)
    backend = target.backend
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
        # Shape queries read the codes already there, in any layout: no dequantize to learn a shape.
        n = resolve(n)
        if n not in ctx._float and n in ctx._quant:
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
        kind = decision.kind if decision is not None else DecisionKind.FLOAT
        if kind is DecisionKind.FUSED:
            continue  # emitted with the last node of its group
        members = _group(node, nodes)
        key = _key(members, kind)
        # An op kept in place must run as written, on float storage that its views share.
        rule = table.get(key) if lowerable(node, kind) else None
        lowered = None
        tail = next(iter(reversed(ctx.graph.nodes)), None)
        if rule is not None:
            lowered = rule(ctx, members, resolve)
        if lowered is not None:
            if lowered.float_layout is None:
                lowered = replace(lowered, float_layout=_inputs_in_float_layout(ctx, members, resolve))
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
            why = node.meta.get(_meta.MUTATION) or next(
                (m.meta[_meta.BN_NOT_FOLDED] for m in members if _meta.BN_NOT_FOLDED in m.meta), placement.why
            )
            placement = Placement(placement.runs, why, _names(members))
        report.placements.update((name, placement) for name in placement.members)
    report.placements.update((name, placed) for name, (_, placed) in ctx.absorbed.items())  # inside another's kernel or table
    gm = fx.GraphModule(root, ctx.graph, "QuantizedModule")
    gm.graph.set_codegen(prepared.graph._codegen)  # a torch.export graph's call and result structure (pytree)
    _tag_placements(gm, nodes, report.placements, ctx.absorbed)
    if _meta.TRACE in prepared.meta:
        gm.meta[_meta.TRACE] = prepared.meta[_meta.TRACE]
    gm.graph.eliminate_dead_code(is_impure_node=_keeps_effect)
    gm.graph.lint()
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm, report
