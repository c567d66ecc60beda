"""decompose_glu: ``F.glu(x, dim)`` / ``nn.GLU(dim)`` written out as ``a, b = x.chunk(2, dim); a * sigmoid(b)``.

A gated linear unit (a conformer's convolution module, gated CNNs for language and audio) is one call no int8
kernel takes, so it ran in float between a dequantize and a quantize. Written out, its halves are views of the
input's codes (``chunk``), the sigmoid a table on its fixed grid and the product lucid_fx's int8 mul: the same
values, computed as the op computes them.

Runs before canonicalize_ops, on the traced calls; the product takes the call's name and module path. With
example inputs, records the new nodes' shapes (``tensor_meta``) as propagate_shapes does.
"""

from __future__ import annotations

import operator
from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

from lucid_fx.passes._rewrite import recompiled, swap_in

__all__ = ["decompose_glu"]


def _dim(gm: fx.GraphModule, node: fx.Node) -> Optional[int]:
    """The dim of a GLU call (-1 by default); None for any other node, or a dim the graph computes."""
    if node.op == "call_module" and isinstance(gm.get_submodule(node.target), nn.GLU):
        dim = gm.get_submodule(node.target).dim
    elif node.op == "call_function" and node.target is F.glu:
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
    else:
        return None
    return dim if isinstance(dim, int) else None


def decompose_glu(gm: fx.GraphModule, example_inputs: Optional[tuple] = None) -> fx.GraphModule:
    """Write out every GLU of ``gm`` (in place) as chunk, sigmoid and product."""

    changed = False
    for node in list(gm.graph.nodes):
        dim = _dim(gm, node)
        if dim is None or len(node.all_input_nodes) != 1:
            continue
        with gm.graph.inserting_before(node):
            halves = gm.graph.call_function(torch.chunk, (node.all_input_nodes[0], 2, dim))
            a, b = (gm.graph.call_function(operator.getitem, (halves, i)) for i in (0, 1))
            out = gm.graph.call_function(operator.mul, (a, gm.graph.call_function(torch.sigmoid, (b,))))
        swap_in(gm, node, out)
        changed = True
    return recompiled(gm, example_inputs) if changed else gm
