"""rewrite_patterns: replace each subgraph a pattern rule recognises (an RMSNorm written out as
``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w``) by the one call it computes
(``F.rms_norm``), so a single int8 kernel takes it. The rules are ``lucid_fx/rules/patterns.py``.

Reads ``node.meta[OP]`` (canonicalize_ops), ``node.meta["tensor_meta"]`` (propagate_shapes). Writes
``OP``, ``tensor_meta`` and ``MODULE_PATH`` on the new node, which takes the name of the node that
ended the subgraph (it computes that node's value, so compare measures it under that name, and the
users' ``OP`` still name it).
"""

from __future__ import annotations

from typing import List, Sequence

from torch import fx

from lucid_fx import _meta
from lucid_fx.ops import CanonicalCall
from lucid_fx.rules.patterns import PATTERN_RULES, Match, PatternRule

__all__ = ["rewrite_patterns"]


def _replace(gm: fx.GraphModule, found: Match) -> None:
    end = found.replaced[-1]
    with gm.graph.inserting_after(end):
        new = gm.graph.call_function(found.target, found.args)
    for key in (_meta.TENSOR_META, _meta.MODULE_PATH):
        if key in end.meta:
            new.meta[key] = end.meta[key]
    spelling = f"{found.target.__module__.replace('torch.nn.functional', 'F')}.{found.target.__name__}"
    new.meta[_meta.OP] = CanonicalCall(found.op, dict(zip(found.params, found.args)), False, spelling)
    end.replace_all_uses_with(new)  # users' OP name the end, and the new node takes its name
    name = end.name
    for node in reversed(found.replaced):
        gm.graph.erase_node(node)
    new.name = name  # freed by the erase: the new node computes the value the old end did


def rewrite_patterns(gm: fx.GraphModule, rules: Sequence[PatternRule] = PATTERN_RULES) -> fx.GraphModule:
    """Rewrite every match of ``rules`` in ``gm``; ends are tried last node first, so the widest
    match (the weight's multiply included) wins over the one inside it."""
    erased: List[fx.Node] = []
    for node in reversed(list(gm.graph.nodes)):
        if node in erased or node.op != "call_function" and node.op != "call_method":
            continue
        for rule in rules:
            found = rule.match(node)
            if found is not None:
                erased.extend(found.replaced)
                _replace(gm, found)
                break
    gm.recompile()
    return gm
