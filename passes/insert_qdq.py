"""insert_qdq: the reference (simulated) model: each observer the int8 model rounds at becomes quantize -> dequantize.

Reads the observers' statistics, ``node.meta[WEIGHT_OBSERVER]`` and ``[FOLDED_BN]``; replaces each observer call
with ``lucid_fx.dequantize_per_tensor(lucid_fx.quantize_per_tensor(x, ...))`` and each observed
linear/conv weight with its quantize -> dequantize image on the kernel's weight grid (a module's
weight in place; a functional weight, ``F.linear(x, self.w)``, through ``quantize_per_channel ->
dequantize_per_channel`` in the graph), so the float graph computes what the int8 kernels
compute, up to rounding inside the kernels. An observer whose value the int8 model never holds as
codes (:func:`values_with_codes`: a residual add or last linear that fold_dequantize keeps float,
a gate's linear, a product's factors) is removed instead; a softmax that convert fuses into its matmul
(``lucid_fx.softmax_matmul``) gets ``lucid_fx.probabilities_qdq``, the same rounding of its
probabilities. Used by ``convert(..., reference=True)`` and as the numeric oracle in tests. Writes ``[SOURCE]`` on each
quantize/dequantize pair and ``[QPARAMS]`` and ``[OBSERVER_KIND]`` on the quantize, as convert does.
"""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Optional, Set, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx._meta import OBSERVERS, WEIGHT_OBSERVERS
from lucid_fx.kernels.target import Target
from lucid_fx.computed_weights import parameter_value
from lucid_fx.node_refs import layer_groups
from lucid_fx.ops import canonical
from lucid_fx.passes.fold_dequantize import FOLDS_TO_FLOAT, fold_dequantize
from lucid_fx.passes.lower_to_int8 import _group, _keeps_effect, lower_to_int8
from lucid_fx.rules.lowering_context import _tag_type
from lucid_fx.rules.lowering_grouped import expert_weights, quantized_experts
from lucid_fx.rules.lowering_attention import softmax_read_only_by
from lucid_fx.quantization.weight import quantize_layer_weight, quantize_weight
from lucid_fx.quantization.fake_quantize import FakeQuantize
from lucid_fx.quantization.functional import dequantize
from lucid_fx.rules.observers import DecisionKind

__all__ = ["insert_qdq", "values_with_codes", "Codes"]

_ops = torch.ops.lucid_fx


@dataclass(frozen=True)
class Codes:
    """What the int8 model of a prepared graph holds as codes (:func:`values_with_codes`), by prepared-node name."""

    rounded: FrozenSet[str]  # values it rounds onto their grids
    inside: FrozenSet[str] = frozenset()  # values another op's kernel or table computes inside (from its inputs' codes)


def _qdq_functional_weight(gm: fx.GraphModule, node: fx.Node, observer, target: Target) -> None:
    # The kernel multiplies by per-channel codes on the layer's grid (quantization.weight.quantize_weight),
    # not by the observer's own grid: give the reference exactly those codes.
    weight = parameter_value(node.args[0])  # self.w, or computed from parameters (lucid_fx/computed_weights.py)
    # The grid of the layers reading the weight (a convolution or linear); the device's where they differ.
    grids = {target.layer_weight_range(weight.shape, layer_groups(gm, layer)) for layer in node.users}
    weight_range = grids.pop() if len(grids) == 1 else target.weight_range
    _, scales = quantize_weight(weight, observer, weight_range, least_error=True)
    key = node.target.split(".", 1)[1]
    for name, value in (("wscale", scales), ("wzp", torch.zeros_like(scales, dtype=torch.int64))):
        gm.register_buffer(f"_lucid_{key}_{name}", value)
    with gm.graph.inserting_before(node):
        scale, zp = gm.graph.get_attr(f"_lucid_{key}_wscale"), gm.graph.get_attr(f"_lucid_{key}_wzp")
        q = gm.graph.call_function(_ops.quantize_per_channel, (node.args[0], scale, zp, 0, *weight_range, torch.int8))
        dq = gm.graph.call_function(_ops.dequantize_per_channel, (q, scale, zp, 0))
    node.replace_all_uses_with(dq)
    gm.graph.erase_node(node)


def _qdq_experts(gm: fx.GraphModule, node: fx.Node, target: Target) -> None:
    """A grouped product's expert weights (in place) as convert quantizes them (rules/lowering_grouped.py)."""
    attr = lambda n: functools.reduce(getattr, n.target.split("."), gm) if n.op == "get_attr" else None  # noqa: E731
    weight = expert_weights(attr, canonical(node).args.get("weight"))
    observers, key = getattr(gm, WEIGHT_OBSERVERS, {}), node.meta.get(_meta.WEIGHT_OBSERVER)
    if weight is not None:
        codes, scales = quantized_experts(weight, target.weight_range, observers[key] if key in observers else None)
        with torch.no_grad():
            weight.copy_(codes * scales.unsqueeze(-1))  # the kernel's weights (zero points 0)


_FLOAT_KINDS = (DecisionKind.FLOAT, DecisionKind.NONE)


def _computed_in_float(node: fx.Node) -> bool:
    decision = node.meta.get(_meta.DECISION)
    return node.op == "placeholder" or decision is None or decision.kind in _FLOAT_KINDS


def _reads_float(node: fx.Node, kernels: Optional[Set[Tuple[str, ...]]]) -> bool:
    """Whether convert would run ``node`` in float: no quantized decision, or no lowering rule
    for it (or its fused group) in ``kernels``, the backend's lowering-table keys."""
    decision = node.meta.get(_meta.DECISION)
    if node.op == "output" or decision is None or decision.kind in _FLOAT_KINDS:
        return True
    if kernels is None or decision.kind is DecisionKind.SHARED:
        return False
    members = _group(node, list(node.graph.nodes))
    return tuple(canonical(m).op for m in members if _meta.OP in m.meta) not in kernels


def _fused_softmax(observer_call: fx.Node, kernels: Optional[Set[Tuple[str, ...]]]) -> bool:
    """Whether convert fuses the softmax ``observer_call`` watches into the one matmul reading it
    (rules/lowering_attention.py): then no grid of its own holds the probabilities."""
    source, readers = observer_call.args[0], list(observer_call.users)
    return (len(readers) == 1 and softmax_read_only_by(source, readers[0])
            and not _reads_float(source, kernels) and not _reads_float(readers[0], kernels))


def _folded(node: fx.Node, codes: Optional[Codes]) -> bool:
    """Whether the int8 model runs ``node``, an add, mul or cat kernel, in float on float inputs
    (fold_dequantize: its value is in no codes), so it reads a float-computed input as it is; the caller leaves
    alone an op inside another's table, whose value is in no codes either."""
    if codes is None or _meta.OP not in node.meta or canonical(node).op not in FOLDS_TO_FLOAT:
        return False
    end = node.meta.get(_meta.FUSED_INTO, node.name)
    return end not in codes.rounded


def _qdq_probabilities(gm: fx.GraphModule, node: fx.Node) -> None:
    """The softmax's probabilities as lucid_fx.softmax_matmul rounds them, in place of its observer."""
    with gm.graph.inserting_before(node):
        p = gm.graph.call_function(_ops.probabilities_qdq, (node.args[0],))
    p.meta[_meta.SOURCE] = node.args[0].name
    _tag_type(p, node.args[0], torch.float32)
    node.replace_all_uses_with(p)
    gm.graph.erase_node(node)


def values_with_codes(gm: fx.GraphModule, lowerings: Dict[str, Dict[Tuple[str, ...], Any]], target: Target) -> Optional[Codes]:
    """The prepared values that the int8 model of ``gm`` holds as codes, and those computed inside another op's
    kernel or table (an elementwise op inside one table: rules/one_source.py): lowered for
    ``target`` and folded (passes/fold_dequantize.py) as convert does, on ``gm``, which is left as it was.
    A value missing here is never rounded there: a residual add or a last linear that only float ops
    and the output read, a softmax inside softmax_matmul, a gate's linear. None, with a warning, where
    lowering fails: the reference (a debugging aid when convert fails too) then rounds every observed value."""
    buffers = set(gm._buffers)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the int8 convert's own warnings, not the reference's
            lowered, _ = lower_to_int8(gm, lowerings, target)
        fold_dequantize(lowered, None)
    except Exception as error:  # noqa: BLE001 - any failure of the int8 lowering: the reference still builds
        warnings.warn(f"reference mode: lowering the graph to int8 failed ({type(error).__name__}: {error}), so the "
                      "reference rounds every observed value, also those an int8 model would keep in float", stacklevel=2)
        return None
    finally:
        for name in set(gm._buffers) - buffers:  # the int8 weights lower_to_int8 put on its root
            del gm._buffers[name]
    rounded = {n.meta[_meta.SOURCE] for n in lowered.graph.nodes if _meta.QPARAMS in n.meta and _meta.SOURCE in n.meta}
    return Codes(frozenset(rounded), frozenset(name for n in lowered.graph.nodes for name in n.meta.get(_meta.ABSORBED, {})))


def insert_qdq(
    gm: fx.GraphModule, target: Target, kernels: Optional[Set[Tuple[str, ...]]] = None, held: Optional[Codes] = None
) -> fx.GraphModule:
    """Rewrite ``gm`` in place into its simulated-quantization reference; ``kernels`` (the
    backend's lowering-table keys) tells which ops convert runs in float; weights take ``target``'s grids.
    ``held`` (:func:`values_with_codes`): the values the int8 model rounds, the others keep their float value
    here too (None: every observed value is rounded); and those computed inside a table of their source's codes,
    which read its rounded value."""
    weight_observers = getattr(gm, WEIGHT_OBSERVERS, {})
    functional_weights = {
        n.meta[_meta.WEIGHT_OBSERVER] for n in gm.graph.nodes if n.op != "call_module" and n.meta.get(_meta.WEIGHT_OBSERVER)
    }
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(node.target, str) and node.target.startswith(OBSERVERS + "."):
            observer = gm.get_submodule(node.target)
            if node.target.split(".", 1)[1] in functional_weights:
                _qdq_functional_weight(gm, node, observer, target)
                continue
            if _fused_softmax(node, kernels):
                _qdq_probabilities(gm, node)
                continue
            source = node.args[0]
            if held is not None and source.meta.get(_meta.FOLDED_BN, source.name) not in held.rounded and source.name not in held.rounded:
                node.replace_all_uses_with(source)  # the int8 model keeps it in float (a gate's linear, a product's factors too)
                gm.graph.erase_node(node)
                continue
            scale, zp = observer.calculate_qparams()
            if scale.numel() != 1:
                continue  # per-channel activations have no per-tensor kernel: left float
            qdtype = observer.qdtype
            with gm.graph.inserting_before(node):
                args = (node.args[0], float(scale), int(zp), qdtype.quant_min, qdtype.quant_max, qdtype.storage)
                q = gm.graph.call_function(_ops.quantize_per_tensor, args)
                dq = gm.graph.call_function(_ops.dequantize_per_tensor, (q, float(scale), int(zp)))
            # A conv that absorbed a batch norm outputs the batch norm's value.
            q.meta[_meta.SOURCE] = dq.meta[_meta.SOURCE] = source.meta.get(_meta.FOLDED_BN, source.name)
            q.meta[_meta.QPARAMS] = (float(scale), int(zp), qdtype.name)
            q.meta[_meta.OBSERVER_KIND] = type(observer).__name__
            _tag_type(q, source, qdtype.storage)
            _tag_type(dq, source, torch.float32)
            node.replace_all_uses_with(dq)
            gm.graph.erase_node(node)
            if _computed_in_float(source):
                # convert hands a float consumer of a float-computed value the value itself, not
                # its quantized image: so does the reference.
                for user in list(dq.users):
                    inside = held is not None and user.name in held.inside  # a table's op: computed from the codes
                    if (_reads_float(user, kernels) or _folded(user, held)) and not inside:
                        user.replace_input_with(dq, source)
        elif node.op == "call_module" and node.meta.get(_meta.WEIGHT_OBSERVER) is not None:
            module = gm.get_submodule(node.target)
            key = node.meta[_meta.WEIGHT_OBSERVER]
            observer = weight_observers[key] if key in weight_observers else None
            if isinstance(observer, FakeQuantize) and node.meta.get(_meta.BN_FOLDED):
                observer = observer.activation_post_process  # folding changed the weight: observe it afresh
            codes, scales = quantize_layer_weight(module.weight, observer, target, getattr(module, "groups", 1))
            with torch.no_grad():
                module.weight.copy_(dequantize(codes, scales, torch.zeros_like(scales, dtype=torch.int64), ch_axis=0))
        elif _meta.OP in node.meta and canonical(node).op == "grouped_mm" and not _reads_float(node, kernels):
            _qdq_experts(gm, node, target)
    gm.graph.eliminate_dead_code(is_impure_node=_keeps_effect)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm
