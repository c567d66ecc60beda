"""decompose_einsum: a two-operand ``torch.einsum`` that is a (batched) matrix product written out as one.

``torch.einsum("bhqd,bhkd->bhqk", q, k)`` is attention's scores in research code and many model ports; as one
call no int8 kernel takes it. Every einsum of two operands whose letters are batch dims (in both operands and the
output), contracted dims (in both, not the output) and free dims (in one operand and the output) is
``permute -> reshape -> matmul -> reshape -> permute``, each step a view or a copy of codes, the product an int8
matmul. Permutes and reshapes that change nothing are left out (``"bhqd,bhkd->bhqk"`` is ``q @ k.permute(0, 1,
3, 2)``). An ellipsis stands for the same leading dims in both operands. Anything else (one operand, three, a
letter repeated in an operand, a dim summed in one operand only, dims of different sizes that broadcast) is left
as it is and runs in float.

Runs after propagate_shapes (it reads the operands' shapes) and records the new nodes' shapes the same way; the
last new node takes the call's name. Reads ``node.meta["tensor_meta"]``; writes ``tensor_meta`` and
``MODULE_PATH`` on the new nodes.
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import torch
from torch import fx
from torch.fx.passes.shape_prop import TensorMetadata

from lucid_fx import _meta

from lucid_fx.passes._rewrite import recompiled, swap_in

__all__ = ["decompose_einsum", "matmul_plan"]

Plan = Tuple[List[int], List[int], List[int], List[int], List[int], List[int]]


def _subscripts(equation: str, ranks: Tuple[int, int]) -> Optional[Tuple[str, str, str]]:
    """The two operands' and the output's letters, an ellipsis spelled as upper-case letters of its own (the
    same ones in both operands: their leading dims); None for what the plan does not take."""
    equation = equation.replace(" ", "")
    if equation.count("->") != 1:
        return None
    inputs, out = equation.split("->")
    operands = inputs.split(",")
    if len(operands) != 2 or any(c.isupper() for c in equation):
        return None
    spelled = []
    for term, rank in zip(operands, ranks):
        if "..." in term:
            extra = rank - len(term.replace("...", ""))
            if extra < 0 or term.count("...") != 1:
                return None
            term = term.replace("...", "ABCDEFGHIJKLMNOP"[:extra])
        spelled.append(term)
    ellipses = [t for t in spelled if t[:1].isupper()]
    if "..." in out:
        if not ellipses:
            return None
        out = out.replace("...", "".join(c for c in max(ellipses, key=len) if c.isupper()))
    a, b = spelled
    if any(len(set(t)) != len(t) or not t.isalpha() for t in (a, b, out)) or not set(out) <= set(a) | set(b):
        return None
    if (set(a) ^ set(b)) - set(out):  # a dim summed in one operand alone
        return None
    return a, b, out


def matmul_plan(equation: str, a_shape, b_shape) -> Optional[Tuple[Plan, Dict[str, int], Tuple[str, str, str]]]:
    """(permutation of a, its reshape, permutation of b, its reshape, the product's reshape, the output's
    permutation), the letters' sizes and the letters, for ``torch.einsum(equation, a, b)``; None where no plan."""
    found = _subscripts(equation, (len(a_shape), len(b_shape)))
    if found is None:
        return None
    a, b, out = found
    if len(a) != len(a_shape) or len(b) != len(b_shape):
        return None
    size: Dict[str, int] = {}
    for term, shape in ((a, a_shape), (b, b_shape)):
        for letter, n in zip(term, shape):
            if size.setdefault(letter, int(n)) != int(n):
                return None  # sizes that broadcast
    batch = [c for c in out if c in a and c in b]
    free_a, free_b = [c for c in a if c in out and c not in b], [c for c in b if c in out and c not in a]
    contract = [c for c in a if c in b and c not in out]
    dims = lambda letters: [size[c] for c in letters]  # noqa: E731
    m, k, n = math.prod(dims(free_a)), math.prod(dims(contract)), math.prod(dims(free_b))
    order = batch + free_a + free_b
    plan = ([a.index(c) for c in batch + free_a + contract], dims(batch) + [m, k],
            [b.index(c) for c in batch + contract + free_b], dims(batch) + [k, n],
            dims(batch) + dims(free_a) + dims(free_b), [order.index(c) for c in out])
    return plan, size, (a, b, out)


def _shape(value) -> Optional[torch.Size]:
    meta = value.meta.get(_meta.TENSOR_META) if isinstance(value, fx.Node) else None
    return meta.shape if isinstance(meta, TensorMetadata) else None


def _operands(node: fx.Node):
    if node.op != "call_function" or node.target is not torch.einsum or node.kwargs or not node.args:
        return None
    equation, rest = node.args[0], list(node.args[1:])
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        rest = list(rest[0])
    return (equation, rest[0], rest[1]) if isinstance(equation, str) and len(rest) == 2 else None


def _write_out(graph: fx.Graph, a: fx.Node, b: fx.Node, plan: Plan, a_shape, b_shape) -> fx.Node:
    perm_a, view_a, perm_b, view_b, view_out, perm_out = plan

    def permute(x, perm):
        return x if perm == sorted(perm) else graph.call_method("permute", (x, *perm))

    def reshape(x, shape, now):
        return x if list(now) == list(shape) else graph.call_method("reshape", (x, *shape))

    x = reshape(permute(a, perm_a), view_a, [a_shape[i] for i in perm_a])
    y = reshape(permute(b, perm_b), view_b, [b_shape[i] for i in perm_b])
    product = graph.call_function(torch.matmul, (x, y))
    return permute(reshape(product, view_out, view_a[:-1] + view_b[-1:]), perm_out)


def decompose_einsum(gm: fx.GraphModule, example_inputs: Optional[tuple] = None) -> fx.GraphModule:
    """Write out every two-operand ``torch.einsum`` of ``gm`` (in place) that is a matrix product and whose
    operands' shapes propagate_shapes recorded; with ``example_inputs``, record the new nodes' shapes too."""

    changed = False
    for node in list(gm.graph.nodes):
        found = _operands(node)
        shapes = (_shape(found[1]), _shape(found[2])) if found is not None else (None, None)
        planned = matmul_plan(found[0], *shapes) if None not in shapes else None
        if planned is None:
            continue
        with gm.graph.inserting_before(node):
            out = _write_out(gm.graph, found[1], found[2], planned[0], *shapes)
        swap_in(gm, node, out)  # the product keeps the einsum's name
        changed = True
    return recompiled(gm, example_inputs) if changed else gm
