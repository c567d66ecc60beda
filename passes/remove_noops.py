"""remove_noops: take out nodes that return their input unchanged in an eval-mode model (no-op
casts, eval-mode dropout and stochastic depth, nn.Identity, contiguous() of a contiguous tensor),
before observers are chosen, so none of them is observed, rounded or left float.

Reads ``node.meta[OP]`` (canonicalize_ops) and ``node.meta["tensor_meta"]`` (propagate_shapes; a
cast whose dtypes are unknown stays). Rewrites the ``OP`` of each removed node's users to name its
input. Writes ``gm.meta[REMOVED]``: the removed node names and why. The rules are
``lucid_fx/rules/noops.py``.
"""

from __future__ import annotations

from torch import fx

from lucid_fx import _meta
from lucid_fx.node_refs import canonical
from lucid_fx.rules.noops import NOOP_RULES

__all__ = ["remove_noops"]


def _rule(gm: fx.GraphModule, node: fx.Node):
    call = node.meta.get(_meta.OP)
    if call is None:
        return None, None
    module = gm.get_submodule(node.target) if node.op == "call_module" else None
    test = NOOP_RULES.get(call.op) or (NOOP_RULES.get(type(module).__name__) if module is not None else None)
    return test, module


def remove_noops(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace every no-op node of ``gm`` by its input; ``gm.meta[REMOVED]`` says which and why."""
    removed = dict(gm.meta.get(_meta.REMOVED, {}))
    for node in list(gm.graph.nodes):
        test, module = _rule(gm, node)
        if test is None:
            continue
        call = canonical(node)
        source = call.args.get("input")
        if not isinstance(source, fx.Node) or node.meta.get(_meta.MUTATION):
            continue
        reason = test(node, call, module)
        if reason is None:
            continue
        for user in list(node.users):
            if _meta.OP in user.meta:
                user.meta[_meta.OP] = user.meta[_meta.OP].replace_input(node, source)
        node.replace_all_uses_with(source)
        extra = [a for a in node.all_input_nodes if a is not source]
        gm.graph.erase_node(node)
        for arg in extra:  # x.dtype read only by the cast: gone with it
            if not arg.users and arg.op == "call_function" and canonical(arg).op == "getattr":
                gm.graph.erase_node(arg)
        removed[node.name] = reason
    gm.meta[_meta.REMOVED] = removed
    gm.recompile()
    return gm
