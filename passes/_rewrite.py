"""The shared tail of the passes that write a call out as other calls (decompose_attention, decompose_einsum,
decompose_glu, rewrite_weight_products): put the new nodes in the old one's place, then check, recompile and
record the new nodes' shapes. Not a pass itself.
"""

from __future__ import annotations

from typing import Optional

from torch import fx

from lucid_fx import _meta
from lucid_fx.passes.propagate_shapes import propagate_shapes

__all__ = ["swap_in", "recompiled"]


def swap_in(gm: fx.GraphModule, node: fx.Node, out: fx.Node) -> None:
    """``out`` (just written before ``node``) in place of ``node``: its users, its name (freed by the erase),
    and its module path on every node written for it."""
    path, name = node.meta.get(_meta.MODULE_PATH), node.name
    node.replace_all_uses_with(out)
    gm.graph.erase_node(node)
    out.name = name
    if path is not None:
        for new in _written(out):
            new.meta.setdefault(_meta.MODULE_PATH, path)


def recompiled(gm: fx.GraphModule, example_inputs: Optional[tuple]) -> fx.GraphModule:
    """``gm`` after a rewrite: checked, recompiled, and with ``example_inputs`` its new nodes' shapes recorded."""
    gm.graph.lint()
    gm.recompile()
    return propagate_shapes(gm, example_inputs) if example_inputs is not None else gm


def _written(end: fx.Node):
    """The nodes ``end`` was computed from that have no shapes yet: the ones just written."""
    found, stack = [], [end]
    while stack:
        n = stack.pop()
        if n in found or _meta.TENSOR_META in n.meta or n.op in ("placeholder", "get_attr"):
            continue
        found.append(n)
        stack.extend(n.all_input_nodes)
    return found
