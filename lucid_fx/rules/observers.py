"""Observer-choice rules: which observer a node's output gets. The first rule whose ops match
and whose action returns a decision wins; ``None`` declines. The kinds of decision are
:class:`DecisionKind`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, FrozenSet, List, Optional, Sequence

from torch import fx

from lucid_fx._meta import MUTATION as _MUTATION
from lucid_fx._meta import TENSOR_META as _TENSOR_META
from lucid_fx._where import caller_location
from lucid_fx.computed_weights import from_parameters, read_only_as_weight
from lucid_fx.ops import canonical
from lucid_fx.rules.float_policies import FLOAT_BY_DESIGN, FLOAT_WHERE_IT_PAYS
from lucid_fx.rules.movers import SHARED_OPS, TUPLE_MOVERS, item_source
from lucid_fx.rules.noops import CASTS
from lucid_fx.rules.recurrences import RECURRENCE_WHY

__all__ = [
    "Decision", "DecisionKind", "ObserverRule", "OBSERVER_RULES", "GUARD_RULES", "OP_RULES", "FALLBACK_RULE",
    "compose_observer_rules", "SHARED_OPS", "INSIDE_RANGE", "TUPLE_MOVERS", "item_source", "ANY",
]

ANY = "*"


class DecisionKind(enum.Enum):
    """How prepare observes a node's output: the plan. Where convert then computes the value is a
    :class:`lucid_fx.placement.Runs`, the outcome: ``FIXED``, ``STATISTICS`` and ``SHARED`` values
    run as an int8 kernel, a table or shared codes where a lowering rule takes them and in float
    where none does; ``FUSED`` nodes run as part of their group's end; ``FLOAT`` runs in float and
    ``NONE`` is ``Runs.NOT_TENSOR``."""

    FIXED = "fixed"  # FixedQParamsObserver from the proven interval
    STATISTICS = "statistics"  # the QConfig's activation observer, calibrated
    SHARED = "shared"  # the same observer as the op's input: values pass through unchanged
    FUSED = "fused"  # inside a fused group: only its last node is observed
    FLOAT = "float"  # output stays float
    NONE = "none"  # not a float tensor: nothing to observe


@dataclass(frozen=True)
class Decision:
    """Which observer a node's output gets (``kind``), why, and the rule (file:line) that chose it.
    ``kind`` may be given by its value (``"statistics"``); it is stored as a :class:`DecisionKind`."""

    kind: DecisionKind
    reason: str
    rule: str = ""
    interval: Any = None
    qconfig: Any = None
    # The op itself runs float (its QConfig is None, or it is registered float) even when its output
    # is observed as the input of a quantized op.
    keep_float: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.kind, str):
            valid = ", ".join(repr(k.value) for k in DecisionKind)
            if self.kind not in {k.value for k in DecisionKind}:
                raise ValueError(f"Decision: kind must be a DecisionKind or one of {valid}, got {self.kind!r}")
            object.__setattr__(self, "kind", DecisionKind(self.kind))


@dataclass(frozen=True)
class ObserverRule:
    ops: FrozenSet[str]
    action: Callable[..., Optional[Decision]]
    where: str


def observer_rule(ops, action) -> ObserverRule:
    ops = frozenset([ops] if isinstance(ops, str) else ops)
    return ObserverRule(ops, action, caller_location())


def _not_float_tensor(node, ctx) -> Optional[Decision]:
    if not ctx.is_float_tensor(node):
        return Decision(DecisionKind.NONE, "not a float tensor")
    return None


def _mutation(node, ctx) -> Optional[Decision]:
    why = node.meta.get(_MUTATION)
    return Decision(DecisionKind.FLOAT, why) if why is not None else None


def _qconfig_none(node, ctx) -> Optional[Decision]:
    if node.op in ("placeholder", "get_attr", "output"):
        return None
    if ctx.qconfig(node) is None:
        return Decision(DecisionKind.FLOAT, "QConfig is None for this module/op", keep_float=True)
    return None


def _user_float(node, ctx) -> Optional[Decision]:
    if ctx.op_name(node) in ctx.registry.float_ops:
        return Decision(DecisionKind.FLOAT, "registered to stay float", keep_float=True)
    return None


def _attention_mask(node, ctx) -> Optional[Decision]:
    if node.op in ("placeholder", "get_attr") or not ctx.feeds_only_masks(node):
        return None
    reason = "attention mask: read exactly, in float, by the masked op (docs/policies.md)"
    return Decision(DecisionKind.FLOAT, reason, qconfig=ctx.qconfig(node))


def _decides_a_choice(node, ctx) -> Optional[Decision]:
    if node.op in ("placeholder", "get_attr") or ctx.qconfig_is_explicit(node) or not ctx.decides_a_choice(node):
        return None
    # A mixture of experts, top 2 of 8 (examples/mixture_of_experts.py): 14.4 dB with the router in int8, 25.9 in float.
    why = "decides a top-k/sort choice (a router picking experts): int8 rounding would flip which rows it picks"
    return Decision(DecisionKind.FLOAT, why, keep_float=True)


def _recurrence(node, ctx) -> Optional[Decision]:
    if node.op in ("placeholder", "get_attr") or ctx.qconfig_is_explicit(node) or not ctx.in_recurrence(node):
        return None
    return Decision(DecisionKind.FLOAT, RECURRENCE_WHY, keep_float=True)


def _float_where_it_pays(node, ctx) -> Optional[Decision]:
    why = FLOAT_WHERE_IT_PAYS.get(ctx.op_name(node))
    if why is None or node.op in ("placeholder", "get_attr") or ctx.qconfig_is_explicit(node) or ctx.reads_kernel_codes(node):
        return None  # a norm that reads a kernel's codes anyway loses nothing in int8 (RuleContext.reads_kernel_codes)
    return Decision(DecisionKind.FLOAT, why, keep_float=True)


def _fused(node, ctx) -> Optional[Decision]:
    if ctx.fused_into(node) not in (None, node.name):
        # The qconfig still matters inside a group: it says how the group's weight is observed
        # (fake-quantized, in QAT).
        return Decision(DecisionKind.FUSED, f"inside fused {ctx.fusion(node)} ending at {ctx.fused_into(node)}", qconfig=ctx.qconfig(node))
    return None


def _proven_interval(node, ctx) -> Optional[Decision]:
    interval = ctx.interval(node)
    if interval is None or node.op in ("placeholder", "get_attr"):
        return None
    qconfig = ctx.qconfig(node)
    if qconfig is not None and not qconfig.range_analysis:
        return None
    return Decision(DecisionKind.FIXED, f"output proven in [{interval[0]:g}, {interval[1]:g}]", interval=interval, qconfig=qconfig)


def _tuple_item(node, ctx) -> Optional[Decision]:
    """An item of a tuple some call returns (nn.MultiheadAttention's ``(output, weights)``, an LSTM's
    ``(output, state)``) is that call's value as it gives it: an item access, with nothing to compute."""
    call = canonical(node)
    inputs = call.tensor_inputs() if call is not None else []
    if len(inputs) != 1 or item_source(node) is not None or ctx.is_float_tensor(inputs[0]):
        return None
    why = f"item {call.args.get('index')!r} of {inputs[0].name}'s output: taken as {inputs[0].name} gives it, in float"
    return Decision(DecisionKind.FLOAT, why, keep_float=True)


def _integer_cast(node, ctx) -> Optional[Decision]:
    """``mask.to(x.dtype)``, ``ids.float()``: where a model's integers (or booleans) become floats, as a graph's
    float input does; the cast runs as written, its values quantized where an int8 op reads them."""
    source = canonical(node).args.get("input")
    if not isinstance(source, fx.Node) or ctx.is_float_tensor(source):
        return None
    dtype = getattr(source.meta.get(_TENSOR_META), "dtype", None)
    what = str(dtype).removeprefix("torch.") if dtype is not None else "non-float"
    why = f"a cast of {source.name}'s {what} values to float: runs as written, quantized where an int8 op reads it"
    return Decision(DecisionKind.FLOAT, why, keep_float=True)


def _shared(node, ctx) -> Optional[Decision]:
    item_of = item_source(node)  # chunk(x)[i]: x's values, on x's grid
    sources = [item_of] if item_of is not None else canonical(node).tensor_inputs()
    if not any(ctx.is_float_tensor(source) for source in sources):
        return None  # e.g. getitem of chunk's tuple: nothing to share; observed on its own if read
    return Decision(DecisionKind.SHARED, "values pass through unchanged: shares the input's observer", qconfig=ctx.qconfig(node))


# Resampling modes whose every value lies inside its input's range: nearest moves codes, the linear modes and
# area average them (bicubic overshoots: observed on its own, in float).
INSIDE_RANGE = frozenset({"nearest", "nearest-exact", "linear", "bilinear", "trilinear", "area"})


def _resample(node, ctx) -> Optional[Decision]:
    return _shared(node, ctx) if canonical(node).args.get("mode", "nearest") in INSIDE_RANGE else None


def _padding(node, ctx) -> Optional[Decision]:  # reflect/replicate/circular move codes; zeros are the zero point's
    args = canonical(node).args
    return _shared(node, ctx) if args.get("mode", "constant") != "constant" or not args.get("value") else None


def _computed_weight(node, ctx) -> Optional[Decision]:
    """A value computed from parameters alone and read only as a layer's weight (Mixtral's ``W.transpose(-2, -1)``,
    a cosine classifier's ``F.normalize(W)``, the cross-attention's cut of ``in_proj_weight``): computed once at
    convert and quantized per channel by the layer (lucid_fx/computed_weights.py); not an activation."""
    if node.op == "get_attr" or not from_parameters(node) or not read_only_as_weight(node):
        return None
    return Decision(DecisionKind.NONE, "a weight computed from parameters: computed once at convert, the layer reading it quantizes it")


def _calibrated(node, ctx) -> Decision:
    reason = "quantized op: calibrated grid" + (f" (fused {ctx.fusion(node)})" if ctx.fusion(node) else "")
    return Decision(DecisionKind.STATISTICS, reason, qconfig=ctx.qconfig(node))


def _statistics(node, ctx) -> Optional[Decision]:
    """An op, or the end of a fused group, that the lowering tables lower: calibrated. A batch norm
    is observed only as the end of a group it folds into, and only where it can fold (next rule)."""
    if ctx.op_name(node) == "batch_norm":
        return None
    return _calibrated(node, ctx) if ctx.lowers(ctx.lowering_key(node)) else None


def _folded_group_end(node, ctx) -> Optional[Decision]:
    """A conv/linear + batch norm group is one int8 kernel once convert folds the batch norm; a
    linear whose output is known not to be 2-D cannot fold (the norm is over dim 1), so declines."""
    if ctx.fused_into(node) != node.name:
        return None
    layer = canonical(node).args.get("input")
    shape = getattr(getattr(layer, "meta", {}).get(_TENSOR_META), "shape", None)
    if layer is not None and canonical(layer).op == "linear" and shape is not None and len(shape) != 2:
        return None
    return _calibrated(node, ctx) if ctx.lowers(ctx.lowering_key(node)) else None  # the key once folded


def _standalone_batch_norm(node, ctx) -> Optional[Decision]:
    """A batch norm no conv or linear folds (DenseNet's after a cat): one table per channel on the codes."""
    if ctx.fused_into(node) is not None:
        return None
    return _calibrated(node, ctx) if ctx.lowers(("batch_norm",)) else None


def _no_float_input(node, ctx) -> Optional[Decision]:
    """``torch.zeros(x.shape[1], 16)`` (a GRU's first state), ``torch.where(mask, 0.0, 1.0)``: a float tensor computed
    from no float input (sizes, numbers, integers, masks), which no other rule took: nothing to quantize where it is
    made; it runs as written, quantized where an int8 op reads it. (Before: "no observer rule quantizes this op".)"""
    if node.op not in ("call_function", "call_method") or any(ctx.is_float_tensor(n) for n in node.all_input_nodes):
        return None
    why = "a tensor made from no float input (sizes, numbers, masks): runs as written, quantized where an int8 op reads it"
    return Decision(DecisionKind.FLOAT, why, keep_float=True)


def _leave_float(node, ctx) -> Optional[Decision]:
    if node.op in ("placeholder", "get_attr"):
        return Decision(DecisionKind.NONE, "graph input (observed only if a quantized op reads it)")
    why = next((FLOAT_BY_DESIGN[op] for op in ctx.lowering_key(node) if op in FLOAT_BY_DESIGN), None)
    return Decision(DecisionKind.FLOAT, why or "no observer rule quantizes this op")  # where it runs is convert's call (lucid_fx.placement)


# The table is a composition, first match wins: guards + user rules + built-in op rules + fallback
# (compose_observer_rules). The guards hold for every op, a user's included.
GUARD_RULES: List[ObserverRule] = [
    observer_rule(ANY, _not_float_tensor),  # ints, shapes, masks -> none
    observer_rule(ANY, _mutation),  # in place, and something else sees the change -> float (functionalize_inplace)
    observer_rule(ANY, _qconfig_none),  # QConfig None -> float
    observer_rule(ANY, _user_float),  # registered float op -> float
    observer_rule(ANY, _fused),  # inside conv+relu etc. -> fused (no observer)
]
OP_RULES: List[ObserverRule] = [
    observer_rule(ANY, _computed_weight),  # F.normalize(W), W.t(), W * g read as a weight -> none (the layer quantizes it)
    observer_rule(ANY, _decides_a_choice),  # router -> softmax -> topk -> float (the choice exact)
    observer_rule(ANY, _attention_mask),  # (1.0 - keep) * -1e4, read only as a mask -> float (exact)
    observer_rule(ANY, _recurrence),  # s = a_t * s + b_t unrolled (Mamba's scan), its coefficients and read-out -> float
    observer_rule(FLOAT_WHERE_IT_PAYS.keys(), _float_where_it_pays),  # layer_norm, rms_norm -> float unless a QConfig names them
    # before the interval: a proven flatten/max_pool would be a FIXED op with no lowering of its own
    observer_rule("getitem", _tuple_item),  # nn.MultiheadAttention(...)[0] -> float, as the module gives it
    observer_rule(CASTS, _integer_cast),  # mask.to(x.dtype), ids.float() -> float, quantized where read
    observer_rule(SHARED_OPS, _shared),  # maxpool/flatten/reshape/... -> input's observer
    observer_rule("interpolate", _resample),  # nearest, bilinear, ... upsampling -> input's observer
    observer_rule("pad", _padding),  # F.pad with zeros, reflect, replicate, circular -> input's observer
    observer_rule(ANY, _proven_interval),  # proven [lo, hi] -> FixedQParamsObserver
    observer_rule(ANY, _statistics),  # an op or fused group with a lowering rule (linear/conv/add/...) -> QConfig activation observer
    observer_rule("batch_norm", _folded_group_end),  # end of conv+bn / linear+bn (2-D) -> observer; folded at convert
    observer_rule("batch_norm", _standalone_batch_norm),  # after a cat, an input, ... -> observer; a table per channel
    observer_rule(ANY, _no_float_input),  # torch.zeros(x.shape[1], 16), where(mask, 0., 1.) -> float, quantized where read
]
FALLBACK_RULE = observer_rule(ANY, _leave_float)  # anything else -> float


def compose_observer_rules(user_rules: Sequence[ObserverRule] = ()) -> List[ObserverRule]:
    """The observer table prepare walks: guards, then ``user_rules`` newest first (a later
    registration wins), then the built-in op rules, then the fallback."""
    return [*GUARD_RULES, *reversed(user_rules), *OP_RULES, FALLBACK_RULE]


OBSERVER_RULES: List[ObserverRule] = compose_observer_rules()  # the built-in table
