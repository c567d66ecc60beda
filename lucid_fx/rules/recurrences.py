"""Linear recurrences: an unrolled scan ``s = a_t * s + b_t`` runs in float, with what it is made of.

A state carried through a loop of products and sums compounds every rounding of every step, and its
coefficients are the worst values an 8-bit grid can hold: a decay ``exp(A * dt)`` lies just below 1,
where a grid over [0, 1] has one code for every 0.4% (0.999 and 0.996 become the same step, so the state
forgets at the wrong rate), and each step's input is a slice of one tensor whose grid its largest steps
set. transformers' Mamba runs its selective scan so on a CPU (no ``mamba_ssm``), and torch.export unrolls it
into one ``mul`` and one ``add`` a token: measured (hidden 768, 64 tokens, 2 layers, random weights) 2.3 dB
output SQNR with the scan in int8, and ``target_sqnr_db=30`` kept 31 of its nodes float and reached 3.2 dB.

So :func:`recurrence_nodes` finds, once per graph, every chain of at least :data:`MIN_STEPS` ``mul``/``add``/
``sub`` steps where each step reads the one before it (directly or through views) and its other operand
does not depend on it: a scan's coefficients are computed before the loop, a residual stream's branch is
computed from the stream, so a transformer's chain of residual adds is no such chain. Around each chain,
float also takes:

- what the steps' other operands are computed from, through elementwise ops and views, up to a product
  (a linear's output), a constant, an input or a value an op outside the region reads too: the decay and
  input coefficients, in float from the layers that make them;
- what reads the chain and is computed only from it, from such values and from constants: the product of
  each state with its read-out vector, the stack of the outputs, the elementwise tail after them.

Linears and convolutions stay int8 (they are the FLOPs), each reading its input quantized once.
"""

from __future__ import annotations

from typing import Dict, FrozenSet, List, Optional, Set

from torch import fx

from lucid_fx.ops import Tag, canonical, ops_tagged

__all__ = ["STEP_OPS", "MIN_STEPS", "RECURRENCE_WHY", "recurrence_nodes"]

#: The ops a linear recurrence's step is made of.
STEP_OPS = frozenset({"mul", "add", "sub"})
#: The shortest chain taken for a recurrence: four unrolled steps of a product and a sum. Rotary embeddings
#: (``q * cos + rotate_half(q) * sin``: 2), norms and gates (at most 3) chain fewer.
MIN_STEPS = 8
RECURRENCE_WHY = ("an unrolled linear recurrence (a scan s = a * s + b): its rounding compounds step after step, "
                  "so it runs float with its coefficients and read-out (lucid_fx/rules/recurrences.py)")

_MOVES = ops_tagged(Tag.MOVES_CODES) | ops_tagged(Tag.VIEW)
_GROWS = ops_tagged(Tag.ELEMENTWISE) | _MOVES  # what the coefficients are computed through
_COLLECTS = frozenset({"cat", "stack"})
_PRODUCTS = ops_tagged(Tag.PRODUCT)
_WEIGHTED = ops_tagged(Tag.WEIGHTED)


def _op(node: fx.Node) -> Optional[str]:
    call = canonical(node) if node.op in ("call_function", "call_method", "call_module") else None
    return call.op if call is not None else None


def _inputs(node: fx.Node) -> List[fx.Node]:
    call = canonical(node)
    return call.tensor_inputs() if call is not None else []


def _depends_on(value: fx.Node, source: fx.Node, order: Dict[fx.Node, int]) -> bool:
    """Whether ``value`` is computed from ``source``: a search back that stops at nodes before it."""
    stack, seen = [value], set()
    while stack:
        node = stack.pop()
        if node is source:
            return True
        if node in seen or order[node] < order[source]:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return False


def _previous_step(value: fx.Node) -> Optional[fx.Node]:
    """The step ``value`` is, or is a view of (``s.unsqueeze(-1)``, ``s[:, 0]``)."""
    while _op(value) in _MOVES and len(_inputs(value)) == 1:
        value = _inputs(value)[0]
    return value if _op(value) in STEP_OPS else None


def _chains(graph: fx.Graph, order: Dict[fx.Node, int]) -> Set[fx.Node]:
    """The steps on a chain of at least :data:`MIN_STEPS`."""
    before: Dict[fx.Node, List[fx.Node]] = {}  # step -> the steps it continues
    for node in graph.nodes:
        if _op(node) not in STEP_OPS:
            continue
        inputs = [a for a in canonical(node).args.values() if isinstance(a, fx.Node)]
        for operand in inputs:
            step = _previous_step(operand)
            if step is not None and not any(_depends_on(o, step, order) for o in inputs if o is not operand):
                before.setdefault(node, []).append(step)
    if not before:
        return set()
    up: Dict[fx.Node, int] = {}  # the longest chain ending at a step
    for node in graph.nodes:
        if _op(node) in STEP_OPS:
            up[node] = 1 + max((up[p] for p in before.get(node, ())), default=0)
    down: Dict[fx.Node, int] = {node: 1 for node in up}  # the longest chain starting at a step
    for node in reversed(graph.nodes):
        for p in before.get(node, ()):
            down[p] = max(down[p], down[node] + 1)
    return {node for node in up if up[node] + down[node] - 1 >= MIN_STEPS}


def _grow_back(node: fx.Node, region: Set[fx.Node]) -> bool:
    """Add to ``region`` what ``node`` is computed from through elementwise ops and views and read only in
    ``region`` (a value int8 ops also read stays int8: Mamba's ``chunk`` of its input projection feeds the
    int8 conv1d with one half and the scan's gate with the other); whether it added any."""
    stack, grew = [node], False
    while stack:
        for source in _inputs(stack.pop()):
            if source not in region and _op(source) in _GROWS and all(user in region for user in source.users):
                region.add(source)
                stack.append(source)
                grew = True
    return grew


def _computable(value: fx.Node, region: Set[fx.Node]) -> bool:
    return value in region or value.op == "get_attr" or _op(value) in _GROWS


def _grow_forward(region: Set[fx.Node]) -> bool:
    """Add to ``region`` what reads it and is computed only from it, constants and values it may compute
    (products, the stack of the outputs, the elementwise tail); whether it added any."""
    grew = False
    for node in list(region):
        for user in node.users:
            op = _op(user)
            if user in region or op is None or op in _WEIGHTED:
                continue
            if (op in _GROWS or op in _COLLECTS or op in _PRODUCTS) and all(
                    _computable(value, region) for value in _inputs(user)):
                region.add(user)
                grew = True
    return grew


def recurrence_nodes(graph: fx.Graph) -> FrozenSet[fx.Node]:
    """The nodes of ``graph`` that run float as part of a linear recurrence (see the module docstring)."""
    order = {node: i for i, node in enumerate(graph.nodes)}
    region = set(_chains(graph, order))
    grew = bool(region)
    while grew:  # back and forward until nothing is added
        grew = any([_grow_back(node, region) for node in list(region)])
        grew = _grow_forward(region) or grew
    return frozenset(region)
