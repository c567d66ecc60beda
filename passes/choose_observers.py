"""choose_observers: decide, by rule table, which observer each node's output gets.

Reads ``node.meta[OP]``, ``[INTERVAL]``, ``[FUSION]``/``[FUSED_INTO]``, ``[MODULE_PATH]`` and
``["tensor_meta"]``; writes ``node.meta[DECISION]`` (a :class:`lucid_fx.rules.observers.Decision`
with the rule's location) and, on an op of ``MEASURED_OPS`` that runs int8 and that no QConfig
names, ``node.meta[MEASURED]`` (its region kind: a candidate for ``precision="measured"``), and on a
recurrent layer (nn.LSTM, nn.GRU, their cells) whose QConfig is not None, ``node.meta[DYNAMIC]``: that
QConfig, with which convert runs it as quantize_dynamic's int8 layer (lucid_fx/rules/recurrent.py). A
second sweep makes sure every quantized op reads quantized inputs: a float input (a graph input,
or the output of an op left float) gets a statistics observer; the members of a fused group whose
end stays float (it has no lowering rule) are not quantized ops.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, FrozenSet, List, Optional, Set, Tuple

from torch import fx
from torch.fx.passes.shape_prop import TensorMetadata

from lucid_fx import _meta
from lucid_fx.ops import Tag, canonical, ops_tagged
from lucid_fx.quantization.qconfig import QConfig, QConfigMapping
from lucid_fx.registry import Registry
from lucid_fx.rules.masks import mask_input, mask_only_nodes
from lucid_fx.rules.choices import choice_only_nodes
from lucid_fx.rules.float_policies import MEASURED_OPS
from lucid_fx.rules.movers import SHARED_OPS, TUPLE_MOVERS
from lucid_fx.rules.observers import ANY, Decision, DecisionKind
from lucid_fx.rules.recurrences import recurrence_nodes
from lucid_fx.rules.recurrent import recurrent_layer
from lucid_fx.rules.tails import TAILS_WHY, keep_tails, reads_tail, tail_sources

__all__ = ["choose_observers", "RuleContext", "QUANTIZED_KINDS"]

# Kinds whose value ends up as integer codes: a quantized op reads quantized inputs.
QUANTIZED_KINDS = (DecisionKind.FIXED, DecisionKind.STATISTICS, DecisionKind.SHARED, DecisionKind.FUSED)
# torch.fx's guards on concrete_args (a part traced with its parent call's constants) return None and bools
_NOT_TENSORS = {"size", "getattr", "output", "_assert_is_none", "_assert", "eq", "chunk", "split", "tensor_split", "unbind"}  # (tuples)
_WEIGHT_ARGS = ("weight", "bias", "running_mean", "running_var")
_WEIGHTED = ops_tagged(Tag.WEIGHTED)
# Ops that pass one tensor's codes on (the observer table's SHARED_OPS, tuples aside), and of those the
# ones that leave them where they are; the int8 products (Tag.PRODUCT) whose output is codes.
_MOVES_CODES = SHARED_OPS - TUPLE_MOVERS - {"getitem"}
_IN_PLACE = frozenset({"contiguous", "identity", "dropout"})
_PRODUCTS = ops_tagged(Tag.PRODUCT)


def _op(node: fx.Node) -> Optional[str]:
    call = canonical(node)
    return call.op if call is not None else None


def _input(node: fx.Node) -> Any:
    call = canonical(node)
    return call.args.get("input") if call is not None else None


class RuleContext:
    """What an observer rule may ask about a node."""

    def __init__(self, gm: fx.GraphModule, registry: Registry, mapping: QConfigMapping, path_prefix: str = "") -> None:
        self.gm, self.registry, self.mapping, self.path_prefix = gm, registry, mapping, path_prefix
        # Users name types any way they like (nn.Sigmoid, torch.sigmoid, "sigmoid"): canonicalise keys once.
        self._types: Dict[Any, Optional[QConfig]] = {}
        for key, qconfig in mapping.object_type_qconfigs.items():
            self._types.setdefault(registry.canonical_name(key), qconfig)
            self._types.setdefault(key, qconfig)
        self._plain = QConfigMapping()
        self._plain.global_qconfig = mapping.global_qconfig
        self._plain.module_name_qconfigs = mapping.module_name_qconfigs
        self._plain.module_name_regex_qconfigs = mapping.module_name_regex_qconfigs
        self._plain.object_type_qconfigs = self._types
        self._groups: Optional[Dict[str, List[fx.Node]]] = None
        self._mask_only: Optional[Set[fx.Node]] = None
        self._choice_only: Optional[FrozenSet[fx.Node]] = None
        self._recurrences: Optional[FrozenSet[fx.Node]] = None
        # propagate_shapes ran (example inputs were given): every tensor value has its tensor_meta
        self._shapes_known = any(_meta.TENSOR_META in n.meta for n in gm.graph.nodes)

    def op_name(self, node: fx.Node) -> str:
        return canonical(node).op

    def module_path(self, node: fx.Node) -> str:
        path = node.meta.get(_meta.MODULE_PATH, "")
        return ".".join(p for p in (self.path_prefix, path) if p)

    def _own_qconfig(self, node: fx.Node) -> Optional[QConfig]:
        key = ".".join(p for p in (self.path_prefix, node.name) if p)
        if key in self.mapping.node_name_qconfigs:
            return self.mapping.node_name_qconfigs[key]
        object_type = type(self.gm.get_submodule(node.target)) if node.op == "call_module" else node.target
        return self._plain.qconfig_for(self.module_path(node), object_type, also_types=(self.op_name(node),))

    def qconfig_is_explicit(self, node: fx.Node) -> bool:
        """Whether ``node``'s QConfig comes from an entry that names it (its node name, module,
        module pattern or op type), not from the global default."""
        key = ".".join(p for p in (self.path_prefix, node.name) if p)
        if key in self.mapping.node_name_qconfigs:
            return True
        object_type = type(self.gm.get_submodule(node.target)) if node.op == "call_module" else node.target
        return self._plain.chose_explicitly(self.module_path(node), (object_type, self.op_name(node)))

    def qconfig(self, node: fx.Node) -> Optional[QConfig]:
        """A fused group (linear + relu) is one kernel with one QConfig: its first member's (the
        weighted op's), and None for all of it when the mapping sets None for any member, so
        ``set_module_name("proj", None)`` keeps proj float even when a functional relu follows."""
        if node.meta.get(_meta.FUSED_INTO) is None:
            return self._own_qconfig(node)
        qconfigs = [self._own_qconfig(member) for member in self._members(node)]
        return None if any(q is None for q in qconfigs) else qconfigs[0]

    def _members(self, node: fx.Node) -> List[fx.Node]:
        """The nodes of the fused group ``node`` belongs to, in graph order (``[node]`` alone if none)."""
        end = node.meta.get(_meta.FUSED_INTO)
        if end is None:
            return [node]
        if self._groups is None:
            self._groups = {}
            for member in self.gm.graph.nodes:
                if member.meta.get(_meta.FUSED_INTO) is not None:
                    self._groups.setdefault(member.meta[_meta.FUSED_INTO], []).append(member)
        return self._groups.get(end, [node])

    def lowering_key(self, node: fx.Node) -> Tuple[str, ...]:
        """What convert looks ``node`` up by in the lowering tables: the canonical ops of the fused
        group it ends, in data-flow order and with a folded batch norm left out, or its own op
        (``("conv2d", "relu")`` for conv + bn + relu, ``("gelu",)``)."""
        if self.fused_into(node) != node.name:
            return (self.op_name(node),)
        ops = tuple(self.op_name(member) for member in self._members(node))
        # a batch norm in a group folds into its conv or linear before lowering (passes/fold_batchnorm.py)
        return tuple(op for op in ops if op != "batch_norm") if len(ops) > 1 else ops

    def lowers(self, key: Tuple[str, ...]) -> bool:
        """Whether a lowering rule for ``key`` is in the registry's tables, for some backend."""
        return any(key in table for table in self.registry.lowerings.values())

    def feeds_only_masks(self, node: fx.Node) -> bool:
        """Whether ``node``'s value reaches only mask inputs (rules/masks.py), so it stays float."""
        if self._mask_only is None:
            self._mask_only = mask_only_nodes(self.gm.graph)
        return node in self._mask_only

    def decides_a_choice(self, node: fx.Node) -> bool:
        """Whether ``node``'s value reaches only top-k/sort choices (rules/observers.py), so it stays float."""
        if self._choice_only is None:
            self._choice_only = choice_only_nodes(self.gm.graph)
        return node in self._choice_only

    def in_recurrence(self, node: fx.Node) -> bool:
        """Whether ``node`` is part of an unrolled linear recurrence (rules/recurrences.py), so it stays float."""
        if self._recurrences is None:
            self._recurrences = recurrence_nodes(self.gm.graph)
        return node in self._recurrences

    def reads_kernel_codes(self, node: fx.Node) -> bool:
        """Whether ``node``'s input is the output of an int8 product (a convolution, linear or matmul that
        runs int8 here, read by nothing else) moved by ops that pass codes on, a permute or reshape
        among them: codes either way, since convert gives a kernel's float result only to a dequantize
        that reads it through ``contiguous`` at most (fold_dequantize). ConvNeXt's depthwise
        convolution -> permute -> LayerNorm: a norm there reads those codes, int8 or float."""
        source, moved = _input(node), False
        while isinstance(source, fx.Node) and len(source.users) == 1 and _op(source) in _MOVES_CODES:
            moved = moved or _op(source) not in _IN_PLACE
            source = _input(source)
        return (moved and isinstance(source, fx.Node) and len(source.users) == 1 and _op(source) in _PRODUCTS
                and self.qconfig(source) is not None and self.lowers(self.lowering_key(source)))

    def interval(self, node: fx.Node):
        return node.meta.get(_meta.INTERVAL)

    def fusion(self, node: fx.Node) -> Optional[str]:
        return node.meta.get(_meta.FUSION)

    def fused_into(self, node: fx.Node) -> Optional[str]:
        return node.meta.get(_meta.FUSED_INTO)

    def is_float_tensor(self, node: fx.Node) -> bool:
        if node.op == "output" or self.op_name(node) in _NOT_TENSORS:
            return False
        tm = node.meta.get(_meta.TENSOR_META)
        if isinstance(tm, TensorMetadata):
            return tm.dtype.is_floating_point
        if tm is not None:
            return False  # tuples, lists: not one tensor
        if node.op == "get_attr":
            value = getattr(self.gm, node.target, None) if "." not in node.target else None
            return value is None or getattr(value, "is_floating_point", lambda: False)()
        if node.op == "placeholder":
            # no example inputs: assume a float tensor; with them, an input that got no tensor_meta
            # held a number, None or a string (forward(x, scale: float = 2.0)), and is no tensor
            return not self._shapes_known
        # Without shapes, a value computed only from non-tensors (x.shape[-1] ** 0.5) is not one.
        sources = canonical(node).tensor_inputs() or [a for a in node.all_input_nodes]
        return any(self.is_float_tensor(source) for source in sources) if sources else True


def _decide(node: fx.Node, ctx: RuleContext) -> Decision:
    op = ctx.op_name(node)
    for rule in ctx.registry.observer_rules:
        if ANY not in rule.ops and op not in rule.ops:
            continue
        decision = rule.action(node, ctx)
        if decision is not None:
            return dataclasses.replace(decision, rule=rule.where)
    return Decision(DecisionKind.FLOAT, "no rule matched")


def _activation_inputs(node: fx.Node):
    call = canonical(node)
    mask = mask_input(node)  # read in float, exactly: never quantized
    for name, value in call.args.items():
        if name in _WEIGHT_ARGS:
            continue
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, fx.Node) and item is not mask:
                yield item


def choose_observers(gm: fx.GraphModule, registry: Registry, mapping: QConfigMapping, path_prefix: str = "") -> fx.GraphModule:
    """Annotate every node of ``gm`` with ``node.meta[DECISION]`` (in place)."""
    ctx = RuleContext(gm, registry, mapping, path_prefix)
    for node in gm.graph.nodes:
        node.meta[_meta.DECISION] = _decide(node, ctx)
    here = "lucid_fx/passes/choose_observers.py:quantized-input sweep"  # the installed path
    quantized = {node.name for node in gm.graph.nodes if node.meta[_meta.DECISION].kind in QUANTIZED_KINDS}
    for node in gm.graph.nodes:
        decision = node.meta[_meta.DECISION]
        if decision.kind not in QUANTIZED_KINDS:
            continue
        if decision.kind is DecisionKind.FUSED and ctx.fused_into(node) not in quantized:
            continue  # a group whose end is not quantized (no lowering rule) runs in float, on float inputs
        for source in _activation_inputs(node):
            prior = source.meta[_meta.DECISION]
            if prior.kind in (DecisionKind.FLOAT, DecisionKind.NONE) and ctx.is_float_tensor(source):
                qconfig = decision.qconfig or ctx.qconfig(node)
                if qconfig is None:
                    continue
                # The output is observed for the consumer; an op the user kept float still runs float.
                source.meta[_meta.DECISION] = Decision(
                    DecisionKind.STATISTICS, f"input of quantized {node.name} ({prior.reason})", here, qconfig=qconfig,
                    keep_float=prior.keep_float,
                )
    _keep_tails(gm, ctx)
    for node in gm.graph.nodes:
        if _measured_candidate(node, ctx):
            node.meta[_meta.MEASURED] = MEASURED_OPS[ctx.op_name(node)]
        if recurrent_layer(gm, node) is not None and ctx.qconfig(node) is not None:
            node.meta[_meta.DYNAMIC] = ctx.qconfig(node)
    return gm


def _keep_tails(gm: fx.GraphModule, ctx: RuleContext) -> None:
    """What a global max reads, through per-point layers, is observed by min and max (lucid_fx/rules/tails.py)."""
    for reader in gm.graph.nodes:
        if _meta.OP not in reader.meta or not reads_tail(reader):
            continue
        for node in tail_sources(gm, reader):
            decision = node.meta[_meta.DECISION]
            group = ctx._members(node) if node.meta.get(_meta.FUSED_INTO) else [node]  # conv + relu: the conv's QConfig
            if decision.kind is not DecisionKind.STATISTICS or any(map(ctx.qconfig_is_explicit, group)) or TAILS_WHY in decision.reason:
                continue
            qconfig = keep_tails(decision.qconfig or ctx.qconfig(node))
            if qconfig is not None:
                node.meta[_meta.DECISION] = dataclasses.replace(decision, qconfig=qconfig, reason=f"{decision.reason}; {TAILS_WHY}")


def _measured_candidate(node: fx.Node, ctx: RuleContext) -> bool:
    """An op of ``MEASURED_OPS`` that runs int8, alone or ending a fused group of unweighted ops (a
    masked softmax's add), that reads no parameter and whose QConfig no entry names (a named
    QConfig forces int8, as for the norms)."""
    decision = node.meta[_meta.DECISION]
    if node.op not in ("call_function", "call_method", "call_module") or ctx.op_name(node) not in MEASURED_OPS:
        return False
    if decision.kind not in (DecisionKind.FIXED, DecisionKind.STATISTICS, DecisionKind.SHARED) or decision.keep_float:
        return False
    end = node.meta.get(_meta.FUSED_INTO)
    members = ctx._members(node) if end is not None else [node]
    if end not in (None, node.name) or any(ctx.op_name(m) in _WEIGHTED for m in members) or ctx.qconfig_is_explicit(node):
        return False
    return not any(source.op == "get_attr" for m in members for source in m.all_input_nodes)
