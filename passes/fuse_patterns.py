"""fuse_patterns: mark chains of ops that run as one quantized kernel.

Reads ``node.meta[OP]`` and ``[MUTATION]`` (an op kept in place fuses with nothing); writes ``node.meta[FUSION]`` (the pattern name) and
``node.meta[FUSED_INTO]`` (the name of the group's last node) on every member. Each member but
the last must have exactly one user, so no intermediate value escapes the group.
"""

from __future__ import annotations

from typing import List, Optional

from torch import fx

from lucid_fx import _meta
from lucid_fx.ops import canonical
from lucid_fx.registry import Registry
from lucid_fx.rules.fusions import FusionRule

__all__ = ["fuse_patterns"]


def _match(node: fx.Node, rule: FusionRule) -> Optional[List[fx.Node]]:
    chain = [node]
    for step_index, step in enumerate(rule.pattern):
        current = chain[-1]
        if canonical(current).op not in step or _meta.FUSED_INTO in current.meta or _meta.MUTATION in current.meta:
            return None
        if step_index == len(rule.pattern) - 1:
            return chain
        if len(current.users) != 1:
            return None
        chain.append(next(iter(current.users)))
    return None


def fuse_patterns(gm: fx.GraphModule, registry: Registry) -> fx.GraphModule:
    """Annotate fused groups in ``gm`` in place (first matching rule wins at each node)."""
    for node in gm.graph.nodes:
        if _meta.FUSED_INTO in node.meta or _meta.OP not in node.meta:
            continue
        for rule in registry.fusion_rules:
            chain = _match(node, rule)
            if chain is None:
                continue
            if any(getattr(gm.get_submodule(n.target), "training", False) for n in chain
                   if n.op == "call_module" and canonical(n).op == "batch_norm"):
                continue  # a training-mode batch norm cannot be folded
            for member in chain:
                member.meta[_meta.FUSION] = rule.name
                member.meta[_meta.FUSED_INTO] = chain[-1].name
            break
    return gm
