"""fold_constants: values a model computes only from its constants are computed once, at prepare.

torch.export lifts every ``torch.tensor(...)`` a model builds into a constant, and the code around it
stays in the graph: DeBERTa's attention scale ``sqrt(tensor(head_dim) * factor)``, BLOOM's ALiBi
``full((), base)`` powers, rotary tables cast with ``.to(float32)``. Each such op ran on every call,
in float, and the convert report listed it as a float op without a lowering rule. This pass computes
them once and the graph reads the result as a buffer (``_lucid_fx_constant_<node>``, saved with the
model), so nothing is left to quantize, round or report.

What counts as constant: a ``get_attr`` of a buffer or tensor constant (never a parameter: QAT
trains those, and convert quantizes weights from them), and a pure call whose inputs are all
constant (``fold_signature_constants``'s rules: no ``call_module``, impure or random op, nothing
written in place or returned). Shapes are not: a graph torch.fx traced runs at every input shape.
Only tensors become buffers: those that a non-constant node reads (the rest goes with them), and
none over ``MAX_BYTES``: a static capture's causal mask expanded to batch x heads x seq x seq would
weigh down every saved file, so it stays computed per call, from the smaller constants it comes from.

Runs after canonicalize_ops and remove_noops (reads and writes ``node.meta[OP]``); writes each
folded node's name into ``gm.meta[REMOVED]`` with why (prepare's pipeline entry counts their matrix
FLOPs, a rotary table's ``inv_freq @ positions``, into ``gm.meta[FOLDED_FLOPS]`` for the convert report).
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List

import torch
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx.ops import CanonicalCall
from lucid_fx.passes.fold_signature_constants import evaluate, foldable_call, kept_by_dead_code_elimination, pinned

__all__ = ["fold_constants", "FOLDED_REASON", "MAX_BYTES"]

FOLDED_REASON = "a constant: computed once, at prepare, from the model's constants (fold_constants)"
PREFIX = "_lucid_fx_constant_"
#: The largest value folded: 4 MiB (a rotary cos or sin table of 8192 positions by 128 dims).
MAX_BYTES = 4 << 20


def _constant_leaf(gm: fx.GraphModule, node: fx.Node) -> Any:
    value = functools.reduce(getattr, node.target.split("."), gm)
    return None if isinstance(value, nn.Parameter) or not isinstance(value, torch.Tensor) else value


def _read_at_run_time(known: Dict[fx.Node, Any]) -> List[fx.Node]:
    """The computed constant tensors a node that is not constant reads: what becomes a buffer."""
    return [node for node, value in known.items() if node.op != "get_attr" and isinstance(value, torch.Tensor)
            and value.device.type != "meta" and any(user not in known for user in node.users)]


def fold_constants(gm: fx.GraphModule) -> fx.GraphModule:
    """Replace, in place, each tensor ``gm`` computes only from its buffers and constants by a buffer."""
    graph, kept = gm.graph, pinned(gm.graph)
    known: Dict[fx.Node, Any] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            value = _constant_leaf(gm, node)
            if value is not None:
                known[node] = value
        elif foldable_call(node, known, kept):
            with torch.no_grad():
                known[node] = evaluate(node, known)
    while True:  # a value too large to keep runs per call, and what it is computed from becomes the buffers
        too_large = [node for node in _read_at_run_time(known) if known[node].numel() * known[node].element_size() > MAX_BYTES]
        if not too_large:
            break
        for node in too_large:
            del known[node]
    for node in _read_at_run_time(known):
        value = known[node]
        name = PREFIX + node.name
        gm.register_buffer(name, value.detach().clone())  # its own storage: a view would tie it to its base
        with graph.inserting_before(node):
            new = graph.get_attr(name)
        new.meta = {**node.meta, _meta.OP: CanonicalCall("get_attr", {}, False, "get_attr")}
        for user in list(node.users):
            if _meta.OP in user.meta:
                user.meta[_meta.OP] = user.meta[_meta.OP].replace_input(node, new)
        node.replace_all_uses_with(new)
    graph.eliminate_dead_code(is_impure_node=kept_by_dead_code_elimination)
    alive = {node.name for node in graph.nodes}
    folded = {node.name: FOLDED_REASON for node in known if node.op != "get_attr" and node.name not in alive}
    gm.meta[_meta.REMOVED] = {**gm.meta.get(_meta.REMOVED, {}), **folded}
    gm.recompile()
    return gm
