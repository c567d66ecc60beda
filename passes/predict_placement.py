"""predict_placement: where lower_to_int8 will run each node of a prepared graph, and why.

Reads ``node.meta[DECISION]``, ``[OP]``, ``[FUSED_INTO]``, ``[OBSERVER]``, ``[DYNAMIC]`` and ``["tensor_meta"]``
and the observers' qparams (or statistics: an attention mask that reached a softmax unfused)
where the answer depends on them; writes nothing. Looks each node or
fused group up in the lowering table as :mod:`lower_to_int8` does (a batch norm that convert will
fold is no part of the key), and tells from the rule what it will emit. A rule may still decline
at convert time (an int32 accumulator that could overflow, geometry computed in the graph); the
converted graph's ``node.meta[PLACEMENT]`` is the answer then. Read through
:func:`lucid_fx.placement.placements`.
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.ops import canonical
from lucid_fx._meta import OBSERVERS
from lucid_fx.passes.lower_to_int8 import _group, _key, _stays_float, lowerable
from lucid_fx.rules.lowering_context import _is_observer_call, readers, watched
from lucid_fx.passes.fold_dequantize import FLOAT_WHY, FOLDED_SHARED, FOLDS_TO_FLOAT
from lucid_fx._placement import Placement, Runs
from lucid_fx.rules import lowering as rules
from lucid_fx.rules.lowering_conv import lower_conv, lower_conv_add, takes as conv_takes
from lucid_fx.rules.lowering_conv_transpose import takes as transposed_takes
from lucid_fx.rules.lowering_shared import takes as shared_takes
from lucid_fx.rules.lowering_norm import normalize_takes
from lucid_fx.rules.lowering_attention import FUSED_SOFTMAX, softmax_read_only_by, unfused_mask
from lucid_fx.rules.lowering_elementwise import _positive_number
from lucid_fx.node_refs import scalar_constant
from lucid_fx.computed_weights import PER_CALL_WHY, computed_per_call
from lucid_fx.rules.one_source import TABLE_WHY, TWO_VALUES_WHY, one_source, two_values
from lucid_fx.rules.lowering_gate import GATE_WHY, PRODUCT_OF, PRODUCT_WHY, gate_after_linear, product_factor
from lucid_fx.rules.masks import mask_input
from lucid_fx.rules.recurrent import dynamic_why, recurrent_layer
from lucid_fx.rules.observers import DecisionKind

__all__ = ["predict_placement"]


def _folds(members: List[fx.Node], i: int) -> bool:
    """Whether convert's fold_batchnorm will fold member ``i``, a batch-norm module, into the conv
    or linear module before it (conv2d+batch_norm+relu is looked up as conv2d+relu)."""
    node = members[i]
    before = members[i - 1] if i > 0 else None
    is_bn = node.op == "call_module" and canonical(node).op == "batch_norm"
    return is_bn and before is not None and before.op == "call_module" and len(before.users) == 1


def _predicted_runs(gm: fx.GraphModule, members: List[fx.Node], rule: Any, key: Tuple[str, ...]) -> Runs:
    """The kind ``rule`` will emit, told from the prepared graph (no qparams needed but fixed ones)."""
    if key == ("shared",):
        return Runs.SHARED
    if rule is rules.lower_elementwise:
        return Runs.TABLE
    if rule is rules.lower_extremum:  # of one value: a table; of two: a max of codes
        return Runs.TABLE if _one_source(gm, members) is not None else Runs.KERNEL
    node, call = members[0], canonical(members[0])
    binary = (rules.GENERIC[("add",)], rules.GENERIC[("mul",)], rules.lower_div)
    constant = _scaling_constant(call) if len(members) == 1 and rule in binary else None
    if constant is not None:  # x * full([], c), x / full([], c): as x * c (rules/lowering_elementwise.py)
        return Runs.TABLE if node.meta[_meta.DECISION].kind is DecisionKind.FIXED and not _rescale_fits(gm, node, call, constant) else Runs.SHARED
    if len(members) != 1 or rule not in binary or len(call.tensor_inputs()) != 1:
        return Runs.TABLE if rule in binary and _one_source(gm, members) is not None else Runs.KERNEL
    number = next((v for v in (call.args.get("input"), call.args.get("other")) if not isinstance(v, fx.Node)), None)
    if call.op == "add" or _positive_number(number) is None or call.args.get("rounding_mode") is not None:
        return Runs.TABLE  # x + c, or x * c for c <= 0: a table on x's codes
    # x * c, x / c: x's codes on a rescaled grid, unless the output has fixed qparams of its own.
    return Runs.TABLE if node.meta[_meta.DECISION].kind is DecisionKind.FIXED and not _rescale_fits(gm, node, call, number) else Runs.SHARED


def _one_source(gm: fx.GraphModule, members: List[fx.Node]) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """rules/one_source.py's answer where its source has codes: the group is one table of them."""
    found = one_source(members) if len(members) == 1 else None
    return found if found is not None and _meta.OBSERVER in found[0].meta else None


def _declines_without_one_source(gm: fx.GraphModule, members: List[fx.Node], rule: Any) -> bool:
    """An elementwise op, or a division of two tensors, that is no table of one value's codes: its rule
    declines (``a / b``, ``torch.where(c, a, b)``); the add, mul, maximum and minimum rules have kernels for two."""
    two = rule is rules.lower_div and len(canonical(members[0]).tensor_inputs()) > 1
    return (rule is rules.lower_elementwise or two) and _one_source(gm, members) is None


def _scaling_constant(call: Any) -> Optional[float]:
    """``c > 0`` of ``x * c`` or ``x / c`` where ``c`` is a 0-dim float constant of the graph (the divisor for
    ``/``), else None."""
    if call.op not in ("mul", "div") or call.args.get("rounding_mode") is not None:
        return None
    operands = [call.args.get("other")] if call.op == "div" else [call.args.get("input"), call.args.get("other")]
    constants = [scalar_constant(v) for v in operands if isinstance(v, fx.Node)]
    return next((_positive_number(c) for c in constants if c is not None), None)


def _rescale_fits(gm: fx.GraphModule, node: fx.Node, call: Any, number: float) -> bool:
    observers = getattr(gm, OBSERVERS, {})
    source = watched(call.tensor_inputs()[0])
    observing = [observers[n.meta[_meta.OBSERVER]] for n in (source, node) if n.meta.get(_meta.OBSERVER) in observers]
    if len(observing) != 2 or not all(getattr(o, "has_data", True) for o in observing):
        return False  # not calibrated yet: the input's grid is unknown
    (in_scale, in_zp), (out_scale, out_zp) = (tuple(float(v) for v in o.calculate_qparams()) for o in observing)
    scale = in_scale * number if call.op == "mul" else in_scale / number
    return in_zp == out_zp and math.isclose(scale, out_scale, rel_tol=1e-6)


def _scales_by_a_computed_number(members: List[fx.Node], rule: Any) -> bool:
    """``x * s`` or ``x / s`` where ``s`` is a number the graph computes (``q.size(-1) ** -0.5``), no constant:
    the grid of the product would depend on it at run time, and the binary rules decline."""
    call = canonical(members[0])
    if len(members) != 1 or rule not in (rules.GENERIC[("mul",)], rules.lower_div) or call.op not in ("mul", "div"):
        return False
    operands = [call.args.get("input"), call.args.get("other")]
    return any(isinstance(v, fx.Node) and not hasattr(v.meta.get(_meta.TENSOR_META), "shape") and scalar_constant(v) is None
               for v in operands)


def _inputs_have_codes(node: fx.Node) -> bool:
    """Whether every float-tensor activation ``node`` reads is observed, so that a rule finds its codes
    (an attention mask is read in float: rules/masks.py)."""
    for source in map(watched, canonical(node).tensor_inputs()):
        if source is mask_input(node):
            continue
        tensor_meta, decision = source.meta.get(_meta.TENSOR_META), source.meta.get(_meta.DECISION)
        is_float = getattr(tensor_meta, "dtype", torch.float32).is_floating_point
        if source.op == "get_attr" or not is_float or (decision is not None and decision.kind is DecisionKind.NONE and source.op != "placeholder"):
            continue  # weights, integers, shapes
        if _meta.OBSERVER not in source.meta:
            return False
    return True


def predict_placement(prepared: fx.GraphModule, table: Dict[Tuple[str, ...], Any]) -> Dict[str, Placement]:
    """Where :func:`lower_to_int8` will run each node of a prepared graph, looked up in ``table`` as
    the pass does, by prepared-node name; a rule may still decline at convert time."""
    nodes = list(prepared.graph.nodes)
    observers = getattr(prepared, OBSERVERS, {})
    found: Dict[str, Placement] = {}
    for node in nodes:
        if node.op in ("placeholder", "get_attr", "output") or _is_observer_call(node) or _meta.OP not in node.meta:
            continue
        decision = node.meta.get(_meta.DECISION)
        kind = decision.kind if decision is not None else DecisionKind.FLOAT
        if kind is DecisionKind.FUSED:
            continue  # placed with the last node of its group
        members = _group(node, nodes)
        key = _key([m for i, m in enumerate(members) if not _folds(members, i)], kind)
        rule = table.get(key) if lowerable(node, kind) else None
        layer = recurrent_layer(prepared, node) if _meta.DYNAMIC in node.meta else None
        if layer is not None:  # lower_recurrent: quantize_dynamic's int8 layer
            placement = Placement(Runs.KERNEL, dynamic_why(layer), ())
        elif rule is None:
            placement = _stays_float(kind, decision, key, rule, "")
        elif not _inputs_have_codes(members[0]) or _scales_by_a_computed_number(members, rule):
            placement = _stays_float(kind, decision, key, rule, "lowering declined")  # the rule will find no codes
        elif _declines_without_one_source(prepared, members, rule):  # a / b
            two = len(members) == 1 and two_values(members[0])
            placement = _stays_float(kind, decision, key, rule, TWO_VALUES_WHY if two else "lowering declined")
        elif unfused_mask(observers, members):  # calibration saw a mask reach it unfused
            placement = _stays_float(kind, decision, key, rule, unfused_mask(observers, members))
        elif rule is rules.lower_conv_transpose2d and not transposed_takes(prepared, members[0]):  # its geometry
            placement = _stays_float(kind, decision, key, rule, "lowering declined")
        elif rule in (lower_conv, lower_conv_add) and not conv_takes(prepared, members[0]):  # an even kernel's "same"
            placement = _stays_float(kind, decision, key, rule, "lowering declined")
        elif rule is rules.lower_normalize and not normalize_takes(members[0]):  # not an L2 norm of the last dim
            placement = _stays_float(kind, decision, key, rule, "lowering declined")
        elif key == ("shared",) and not shared_takes(members[0]):  # a max pool with indices, to several values
            placement = _stays_float(kind, decision, key, rule, "lowering declined")
        elif computed_per_call(members[0]):  # F.linear(x, w + noise): no weight to quantize once
            placement = _stays_float(kind, decision, key, rule, PER_CALL_WHY)
        elif rule is rules.lower_sum and rules.sums_products(members[0]):
            placement = _stays_float(kind, decision, key, rule, rules.SUM_OF_PRODUCTS_WHY)
        else:
            placement = Placement(_predicted_runs(prepared, members, rule, key), "+".join(key), ())
        placement = Placement(placement.runs, placement.why, tuple(m.name for m in members))
        found.update((name, placement) for name in placement.members)
    _predict_tables(prepared, nodes, found)
    _predict_folds(nodes, found)
    _predict_absorbed(nodes, found)
    return found


def _predict_tables(gm: fx.GraphModule, nodes: List[fx.Node], found: Dict[str, Placement]) -> None:
    """The elementwise ops computed inside a later op's table (rules/one_source.py), with no value of their own;
    a later table that takes an earlier one's inside names itself, as lower_to_int8's absorb does."""
    for node in nodes:
        placement = found.get(node.name)
        inside = _one_source(gm, [node]) if placement is not None and placement.runs is Runs.TABLE else None
        for inner in inside[1] if inside is not None else ():
            found[inner.name] = Placement(Runs.TABLE, TABLE_WHY.format(end=node.name, source=inside[0].name), (inner.name,))


def _predict_absorbed(nodes: List[fx.Node], found: Dict[str, Placement]) -> None:
    """The pairs lower_to_int8 runs as one kernel though prepare observed both: a softmax read only by
    its matmul's left operand (softmax_matmul), a linear read only by its tanh or sigmoid (its post-op),
    a linear's result read only by a product (computed in float inside it)."""
    for node in nodes:
        placement, reads = found.get(node.name), readers(node)[1]
        if placement is None or len(reads) != 1 or reads[0].name not in found:
            continue
        reader, read = reads[0], found[reads[0].name]
        if placement.runs is Runs.KERNEL and read.runs is Runs.KERNEL and read.why == "matmul" \
                and softmax_read_only_by(node, reader):
            found[node.name] = Placement(Runs.KERNEL, FUSED_SOFTMAX.format(matmul=reader.name), (node.name,))
        elif placement.why == "linear" and read.runs is Runs.TABLE and gate_after_linear(node, reader):
            found[node.name] = Placement(Runs.KERNEL, GATE_WHY.format(act=reader.name), (node.name,))
            found[reader.name] = Placement(Runs.KERNEL, read.why, read.members)
        if read.runs is Runs.KERNEL and read.why in ("mul", PRODUCT_OF) and found[node.name].runs is not Runs.FLOAT \
                and product_factor(node, reader):
            found[node.name] = Placement(Runs.KERNEL, PRODUCT_WHY.format(mul=reader.name), (node.name,))
            found[reader.name] = Placement(Runs.KERNEL, PRODUCT_OF, read.members)


def _predict_folds(nodes: List[fx.Node], found: Dict[str, Placement]) -> None:
    """What fold_dequantize will do, to its fixpoint: an add, mul or cat kernel whose value only
    float ops and the graph's output read runs in float."""
    changed = True
    while changed:
        changed = False
        for node in reversed(nodes):
            placement = found.get(node.name)
            if placement is None or placement.value != node.name or not (
                    placement.runs is Runs.KERNEL and placement.why.split("+")[0] in FOLDS_TO_FLOAT
                    or placement.runs is Runs.SHARED and canonical(node).op in FOLDED_SHARED):
                continue
            reads = readers(node)[1]
            if reads and all(r.op == "output" or getattr(found.get(r.name), "runs", None) is Runs.FLOAT for r in reads):
                folded = Placement(Runs.FLOAT, f"{placement.why} {FLOAT_WHY}", placement.members)
                found.update((name, folded) for name in folded.members)
                changed = True
