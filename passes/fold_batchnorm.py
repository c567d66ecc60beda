"""fold_batchnorm: fold eval-mode batch norm into the conv or linear before it.

Reads ``node.meta[OP]``, writes ``node.meta[BN_FOLDED]`` and ``[FOLDED_BN]`` and, where a fused
batch norm cannot fold, ``node.meta[BN_NOT_FOLDED]``; rewrites ``conv -> batch_norm`` (and ``linear ->
batch_norm``) where the conv/linear is a module whose output only feeds the batch norm: the
module's weight and bias absorb the normalisation and the batch-norm node is removed. A module
that is also reached another way (called again, with or without a batch norm, or its weight read
in the graph) is left as it is: that call gets a folded copy of its own, so every other call
still computes what it did. A linear is folded only when its output is known (``tensor_meta``)
to be 2-D. Works on the graph it is given.
"""

from __future__ import annotations

from torch import fx, nn

from lucid_fx import _meta
from lucid_fx.quantization.fold_bn import fold_bn_into
from lucid_fx.ops import Tag, canonical, ops_tagged

__all__ = ["fold_batchnorm"]

_FOLDABLE = ops_tagged(Tag.WEIGHTED)  # conv1d/2d/3d, linear
_NOT_AFTER_A_LAYER = "its input is not a conv or linear module"


def _rank(node: fx.Node) -> int:
    meta = node.meta.get(_meta.TENSOR_META)
    return len(meta.shape) if meta is not None and hasattr(meta, "shape") else -1


def _reached_elsewhere(gm: fx.GraphModule, layer_node: fx.Node) -> bool:
    """Whether the module ``layer_node`` calls is also called, or read, by another node: directly,
    through a parameter (``get_attr conv.weight``), or inside an enclosing module called as a leaf."""
    target = layer_node.target
    for node in gm.graph.nodes:
        if node is layer_node or node.op not in ("call_module", "get_attr"):
            continue
        if node.target == target or node.target.startswith(target + ".") or target.startswith(node.target + "."):
            return True
    return False


def _own_copy(gm: fx.GraphModule, layer_node: fx.Node, bn_node: fx.Node, folded: nn.Module) -> str:
    """Register ``folded`` next to the module ``layer_node`` calls, under a free name; its path."""
    parent_name, _, attr = layer_node.target.rpartition(".")
    parent = gm.get_submodule(parent_name) if parent_name else gm
    name, n = f"{attr}_folded_{bn_node.name}", 1
    while hasattr(parent, name):
        name, n = f"{attr}_folded_{bn_node.name}_{n}", n + 1
    parent.add_module(name, folded)
    return f"{parent_name}.{name}" if parent_name else name


def _why_not(gm: fx.GraphModule, bn_node: fx.Node, layer_node) -> str:
    """Why a batch norm is not folded into the layer before it, or "" when it can be."""
    if not (isinstance(layer_node, fx.Node) and layer_node.op == "call_module"):
        return _NOT_AFTER_A_LAYER
    if canonical(layer_node) is None or canonical(layer_node).op not in _FOLDABLE:
        return _NOT_AFTER_A_LAYER
    if len(layer_node.users) != 1:
        return f"{layer_node.name}'s output is also read without the batch norm"
    bn = gm.get_submodule(bn_node.target)
    layer = gm.get_submodule(layer_node.target)
    if bn.training or bn.running_mean is None:
        return "it has no running statistics (training mode, or track_running_stats=False)"
    if canonical(layer_node).op == "linear" and _rank(layer_node) != 2:
        # batch norm normalises dim 1; a linear's features are the last dim: the same only in 2-D
        rank = _rank(layer_node)
        return (f"it normalises dim 1 of {layer_node.name}'s {rank}-D output, not the linear's output features"
                if rank > 0 else f"{layer_node.name}'s output rank is unknown (prepare had no example_inputs)")
    if layer.weight.shape[0] != bn.num_features:
        return f"it has {bn.num_features} features and {layer_node.name} has {layer.weight.shape[0]} outputs"
    return ""


def fold_batchnorm(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold every eval-mode ``conv/linear -> batch_norm`` module pair of ``gm`` in place."""
    for bn_node in list(gm.graph.nodes):
        call = canonical(bn_node)
        if call is None or call.op != "batch_norm" or bn_node.op != "call_module":
            continue
        layer_node = bn_node.args[0]
        why = _why_not(gm, bn_node, layer_node)
        if why:
            if why != _NOT_AFTER_A_LAYER:  # a standalone batch norm was never meant to fold
                bn_node.meta[_meta.BN_NOT_FOLDED] = f"batch norm not folded: {why}; runs in float"
            continue
        folded = fold_bn_into(gm.get_submodule(layer_node.target), gm.get_submodule(bn_node.target))
        if _reached_elsewhere(gm, layer_node):
            layer_node.target = _own_copy(gm, layer_node, bn_node, folded)
        else:
            parent_name, _, attr = layer_node.target.rpartition(".")
            setattr(gm.get_submodule(parent_name) if parent_name else gm, attr, folded)
        for node in gm.graph.nodes:  # canonical calls name their inputs too (not only direct users)
            if _meta.OP in node.meta:
                node.meta[_meta.OP] = node.meta[_meta.OP].replace_input(bn_node, layer_node)
        layer_node.meta[_meta.BN_FOLDED] = True
        layer_node.meta[_meta.FOLDED_BN] = bn_node.name  # the node now outputs the batch norm's value
        bn_node.replace_all_uses_with(layer_node)
        for key in (_meta.FUSION, _meta.FUSED_INTO, _meta.OBSERVER, _meta.DECISION):
            if key in bn_node.meta:
                layer_node.meta[key] = bn_node.meta[key]
        gm.graph.erase_node(bn_node)
        if not any(n.op == "call_module" and n.target == bn_node.target for n in gm.graph.nodes):
            gm.delete_submodule(bn_node.target)
    gm.graph.lint()
    # Only folded batch norms go: deleting every unused submodule also dropped the weight
    # observers, which the graph does not call but lowering reads.
    gm.recompile()
    return gm
