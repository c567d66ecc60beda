"""One source: the elementwise ops that compute a value from one other value, found so the whole runs as one table.

A per-tensor int8 value has 256 codes, so any value computed from it element by element, however many
ops and branches it takes (``torch.where(x > 0, x, 0.1 * x)``, ``torch.maximum(x, 0.2 * x)``,
``x * torch.sigmoid(1.702 * x)``, GPT-2's ``0.5 * x * (1 + tanh(c * (x + 0.044715 * x ** 3)))``), is a
256-entry table of ``x``'s codes: the float ops run once, at convert, on every code, and the result is
rounded once onto the end's grid. Without it each op rounds on its own grid, and an op of two tensors
(``where``, ``maximum``, ``x * sigmoid(x)``) needs a kernel of its own or runs in float.

:func:`one_source` is a question about the prepared graph, so convert (rules/lowering_elementwise.py)
and explain (passes/predict_placement.py) ask it alike. The nodes it takes inside are elementwise ops
(``Tag.ELEMENTWISE``, named by a spelling the op table knows) that nothing outside reads, are in no fused
group and are not kept float or in place, nor a linear's tanh/sigmoid post-op (rules/lowering_gate.py: computed
from the linear's float result, which is more than its codes hold); every operand outside is the one source or a
number.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.node_refs import attr_value, canonical
from lucid_fx.ops import Tag, ops_tagged
from lucid_fx.rules.lowering_context import readers, watched
from lucid_fx.rules.lowering_gate import gate_after_linear
from lucid_fx.rules.observers import DecisionKind

__all__ = ["one_source", "evaluate", "two_values", "TABLE_WHY", "TWO_VALUES_WHY"]

_ELEMENTWISE = ops_tagged(Tag.ELEMENTWISE)
_INSIDE = (DecisionKind.FIXED, DecisionKind.STATISTICS, DecisionKind.SHARED, DecisionKind.NONE)  # NONE: a bool mask
_LIMIT = 64  # nodes inside one table, at most (a walk up a long graph stops there)
TABLE_WHY = "inside {end}'s table (one lookup of {source}'s codes)"
#: Why an elementwise op of two values that is no table of one value's codes (``a / b``) runs in float.
TWO_VALUES_WHY = "an elementwise op of two values (not one value's table) with no int8 kernel: runs in float"


def two_values(node: fx.Node) -> bool:
    """Whether ``node`` reads two or more tensors (not numbers the graph computes, ``q.size(-1) ** -0.5``)."""
    return sum(hasattr(n.meta.get(_meta.TENSOR_META), "shape") for n in canonical(node).tensor_inputs()) > 1


def _one_number(arg: fx.Node) -> Optional[torch.Tensor]:
    """A constant of the graph that holds one number (``torch.full([], c)``, a PReLU's one slope)."""
    value = attr_value(arg)
    return value if isinstance(value, torch.Tensor) and value.numel() == 1 else None


def _elementwise(node: fx.Node) -> bool:
    call = canonical(node) if node.op in ("call_function", "call_method", "call_module") else None
    decision = node.meta.get(_meta.DECISION)
    return (call is not None and call.op in _ELEMENTWISE and decision is not None and decision.kind in _INSIDE
            and not decision.keep_float and _meta.FUSED_INTO not in node.meta and _meta.MUTATION not in node.meta
            and not any(gate_after_linear(v, node) for v in _operands(node)))  # a linear's post-op: from its float result


def _operands(node: fx.Node) -> List[fx.Node]:
    found: List[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), lambda n: found.append(watched(n)))
    return found


def _sources(node: fx.Node, inside: Set[fx.Node], memo: Dict[fx.Node, Set[fx.Node]]) -> Set[fx.Node]:
    """The values outside ``inside`` that ``node`` reads, directly or through nodes inside (numbers aside)."""
    if node not in memo:
        memo[node] = set()
        for arg in _operands(node):
            if arg in inside:
                memo[node] |= _sources(arg, inside, memo)
            elif _one_number(arg) is None:
                memo[node].add(arg)
    return memo[node]


def _prune(inside: Set[fx.Node], members: List[fx.Node]) -> bool:
    """Take out of ``inside`` the nodes something outside reads (they have codes of their own: a source) and the
    lowest nodes that read two values (``ln(h) * sigmoid(h)`` under a gelu: the gelu is a table of the product);
    whether any went."""
    memo: Dict[fx.Node, Set[fx.Node]] = {}
    many = lambda n: len(_sources(n, inside, memo)) > 1  # noqa: E731
    out = [n for n in inside if n not in members and (any(r not in inside for r in readers(n)[1])
                                                      or many(n) and not any(many(a) for a in _operands(n) if a in inside))]
    inside.difference_update(out)
    return bool(out)


def one_source(members: List[fx.Node]) -> Optional[Tuple[fx.Node, List[fx.Node]]]:
    """The one value the group ``members`` computes elementwise from, and the nodes between (in an order
    that evaluates them), each read only inside; None where it reads two values, or a tensor constant."""
    inside: Set[fx.Node] = set(members)
    frontier = list(members)
    while frontier:  # the elementwise ops above, reached through elementwise ops
        for arg in _operands(frontier.pop()):
            if arg not in inside and len(inside) < _LIMIT and _elementwise(arg):
                inside.add(arg)
                frontier.append(arg)
    while _prune(inside, members):
        pass
    sources = set().union(*(_sources(m, inside, {}) for m in members)) - set(members)
    if len(sources) != 1:
        return None
    order: List[fx.Node] = []

    def visit(node: fx.Node) -> None:  # operands first
        if node in inside and node not in order and node not in members:
            for arg in _operands(node):
                visit(arg)
            order.append(node)

    for member in members:
        for arg in _operands(member):
            visit(arg)
    return next(iter(sources)), order


def evaluate(module: Any, source: fx.Node, nodes: List[fx.Node], values: torch.Tensor) -> Optional[torch.Tensor]:
    """Run the float ops of ``nodes`` (in order) with ``values`` for ``source``: the last node's values, or
    None where an op cannot run on a 1-D tensor."""
    env = {source: values}

    def value(arg: fx.Node) -> Any:
        arg = watched(arg)
        return env[arg].clone() if arg in env else _one_number(arg)  # a clone: an in-place op changes its own

    try:
        with torch.no_grad():
            for node in nodes:
                args, kwargs = fx.node.map_arg((node.args, node.kwargs), value)
                if node.op == "call_module":
                    env[node] = module.get_submodule(node.target)(*args, **kwargs)
                elif node.op == "call_method":
                    env[node] = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    env[node] = node.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op that cannot run on a 1-D table stays as it was
        return None
    out = env[nodes[-1]]
    ok = isinstance(out, torch.Tensor) and out.shape == values.shape and not out.isnan().any()  # log of a grid's 0 is -inf,
    return out.float() if ok else None  # a code like any other; of its negative values NaN, which no code holds
