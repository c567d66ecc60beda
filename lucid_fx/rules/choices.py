"""Choices: the values that only decide an order-based choice (which experts a mixture of experts' router
picks, the order rows are grouped in), found once per graph from the output up, as rules/masks.py finds what
feeds only masks. observers.py keeps them float: int8 rounding would flip the choice."""

from __future__ import annotations

from typing import Any, FrozenSet

from lucid_fx._meta import OP
from lucid_fx.ops import canonical

__all__ = ["CHOICES", "choice_only_nodes"]

# Ops that choose by order: which experts a router picks (top-k), the order rows are grouped in (sort).
CHOICES = frozenset({"topk", "sort", "argsort", "argmax", "argmin", "kthvalue", "msort"})


def choice_only_nodes(graph) -> FrozenSet[Any]:
    """The nodes whose every use ends in an order-based choice (:data:`CHOICES`), directly or through
    ops that read only them: a mixture of experts' router logits and probabilities. One pass from the
    output up (a node's users come after it), as rules/masks.py finds what feeds only masks."""
    found = set()
    for node in reversed(graph.nodes):
        if node.users and all(_leads_to_a_choice(user, node, found) for user in node.users):
            found.add(node)
    return frozenset(found)


def _leads_to_a_choice(user, node, found) -> bool:
    if OP not in user.meta:
        return False
    call = canonical(user)
    return call.op in CHOICES or (user in found and call.tensor_inputs() == [node])
