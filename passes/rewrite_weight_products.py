"""rewrite_weight_products: ``x @ W``, where ``W`` is a 2-D weight of the model's own, written as the layer it is:
``F.linear(x, W.T)``.

Models multiply by a parameter directly: ``x @ self.weight`` in hand-written layers, a tied embedding's
``h @ wte.weight.T``, a cosine classifier's ``x @ F.normalize(self.w, dim=-1).t()``. As a product of two
tensors, the weight was observed and rounded as an activation (one scale for the whole tensor) and quantized
again on every call; as a linear's weight it is quantized once, per output channel, computed once if the model
computes it from parameters (``lucid_fx/computed_weights.py``), and the product runs as the int8 linear kernel,
fused with a relu after it like any linear. The values are the same: ``x @ W == F.linear(x, W.T)``.

What counts as such a weight: a 2-D float tensor the graph computes from parameters and buffers alone
(:func:`lucid_fx.computed_weights.from_parameters`), on the right of ``@``, ``torch.matmul``, ``torch.mm`` or
their methods; a product of two activations, or with the weight on the left, stays a product.

Runs before canonicalize_ops, on the traced calls; the linear takes the product's name and module path. With
example inputs, records the new nodes' shapes (``tensor_meta``) as propagate_shapes does.
"""

from __future__ import annotations

import operator
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx.computed_weights import from_parameters, parameter_value
from lucid_fx.passes._rewrite import recompiled, swap_in

__all__ = ["rewrite_weight_products"]

_PRODUCTS = frozenset({operator.matmul, torch.matmul, torch.mm})
_PRODUCT_METHODS = frozenset({"matmul", "mm", "__matmul__"})


def _operands(node: fx.Node) -> Optional[Tuple[fx.Node, fx.Node]]:
    """``(x, W)`` of a product ``x @ W`` whose ``W`` is a 2-D float weight of the model's own, else None."""
    spelled = node.op == "call_function" and node.target in _PRODUCTS or node.op == "call_method" and node.target in _PRODUCT_METHODS
    if not spelled or len(node.args) != 2 or node.kwargs:
        return None
    x, weight = node.args
    if not isinstance(x, fx.Node) or from_parameters(x) or not from_parameters(weight):
        return None
    value = parameter_value(weight)
    ok = isinstance(value, torch.Tensor) and value.dim() == 2 and value.is_floating_point()
    return (x, weight) if ok else None


def rewrite_weight_products(gm: fx.GraphModule, example_inputs: Optional[tuple] = None) -> fx.GraphModule:
    """Write every ``x @ W`` of ``gm`` whose ``W`` is a weight of the model's own as ``F.linear(x, W.T)`` (in place)."""
    changed = False
    for node in list(gm.graph.nodes):
        operands = _operands(node)
        if operands is None:
            continue
        x, weight = operands
        with gm.graph.inserting_before(node):
            out = gm.graph.call_function(F.linear, (x, gm.graph.call_function(torch.transpose, (weight, 0, 1))))
        swap_in(gm, node, out)
        changed = True
    return recompiled(gm, example_inputs) if changed else gm
