"""Weights a model computes from its parameters: ``F.linear(x, self.w * self.gain)``, a cosine classifier's
``F.normalize(self.w, dim=-1)``, a tied embedding's ``h @ wte.weight.T``, nn.MultiheadAttention's cut of
``in_proj_weight`` into the query's rows and the key's and value's.

A value computed from parameters and buffers alone, by pure calls (:func:`lucid_fx.node_refs.pure_call`), is
the same on every call of a frozen model, as a converted one is: convert computes it once and quantizes it per
channel as the layer's weight, as it does a parameter read as it is; prepare observes it as one (the weight
observer sees the computed value; in QAT it is fake-quantized after the computation, which trains through it).
A buffer the graph writes in place (a cache) is no constant, nor is anything computed from it.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Set

import torch
from torch import fx

from lucid_fx.node_refs import attr_value, canonical, pure_call, writes_in_place
from lucid_fx.ops import Tag, ops_tagged

__all__ = ["from_parameters", "parameter_value", "read_only_as_weight", "computed_per_call", "WEIGHT_ARGS", "PER_CALL_WHY"]

#: The arguments of a canonical op that a kernel reads as its weight (quantized per channel) or bias.
WEIGHT_ARGS = ("weight", "bias")
#: Why a layer whose weight the graph computes from more than parameters runs in float.
PER_CALL_WHY = "its weight is computed on every call (from an input or a random op), so it has no int8 form computed once: runs in float"


def _written(graph: fx.Graph) -> Set[str]:
    """The attributes (``get_attr`` targets) ``graph`` writes in place, directly or through anything computed from them."""
    written: Set[str] = set()
    for node in graph.nodes:
        if writes_in_place(node) and node.args and isinstance(node.args[0], fx.Node):
            stack, seen = [node.args[0]], set()
            while stack:
                n = stack.pop()
                if n in seen:
                    continue
                seen.add(n)
                if n.op == "get_attr":
                    written.add(n.target)
                stack.extend(n.all_input_nodes)
    return written


def from_parameters(node: Any, _written_attrs: Optional[Set[str]] = None) -> bool:
    """Whether ``node`` is a tensor the graph computes from its module's parameters and buffers alone, by pure calls."""
    if not isinstance(node, fx.Node):
        return False
    written = _written(node.graph) if _written_attrs is None else _written_attrs
    if node.op == "get_attr":
        return isinstance(attr_value(node), torch.Tensor) and node.target not in written
    inputs = node.all_input_nodes
    return pure_call(node) and bool(inputs) and all(from_parameters(n, written) for n in inputs)


def parameter_value(node: Any, _known: Optional[Dict[fx.Node, Any]] = None) -> Optional[Any]:
    """The value of a :func:`from_parameters` node, computed now from its graph's module; None for any other."""
    if not from_parameters(node):
        return None
    known = {} if _known is None else _known
    if node not in known:
        if node.op == "get_attr":
            known[node] = attr_value(node)
        else:
            for source in node.all_input_nodes:
                parameter_value(source, known)
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), known.__getitem__)
            call = getattr(args[0], node.target) if node.op == "call_method" else node.target
            with torch.no_grad():
                known[node] = call(*args[1:], **kwargs) if node.op == "call_method" else call(*args, **kwargs)
    return known[node]


def read_only_as_weight(node: fx.Node) -> bool:
    """Whether every reader of ``node`` reads it as a layer's weight or bias, or computes only such a weight from it."""
    def as_weight(user: fx.Node) -> bool:
        call = canonical(user)
        return call is not None and any(call.args.get(arg) is node for arg in WEIGHT_ARGS)

    return bool(node.users) and all(as_weight(u) or (from_parameters(u) and read_only_as_weight(u)) for u in node.users)


def computed_per_call(node: fx.Node) -> bool:
    """Whether ``node`` is a functional layer (``F.linear``, ``F.conv2d``) whose weight or bias the graph computes
    from more than parameters: no int8 weight can be made once (convert runs it in float, explain says so)."""
    call = canonical(node) if node.op != "call_module" else None
    if call is None or call.op not in ops_tagged(Tag.WEIGHTED):
        return False
    return any(isinstance(call.args.get(arg), fx.Node) and not from_parameters(call.args.get(arg)) for arg in WEIGHT_ARGS)
