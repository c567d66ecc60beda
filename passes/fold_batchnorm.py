"""fold_batchnorm: fold eval-mode batch norm into the conv or linear before it.

Reads ``node.meta[OP]``, writes ``node.meta[BN_FOLDED]`` and ``[FOLDED_BN]``; rewrites ``conv -> batch_norm`` (and
``linear -> batch_norm``) where the conv/linear is a module whose output only feeds the batch norm: the module's weight and bias
absorb the normalisation and the batch-norm node is removed. A linear is folded only when
its output is known (``tensor_meta``) to be 2-D. Works on the graph it is given.
"""

from __future__ import annotations

import copy

import torch
from torch import fx, nn

from lucid_fx import _meta

__all__ = ["fold_batchnorm", "fold_bn_into"]

_FOLDABLE = ("conv1d", "conv2d", "conv3d", "linear")


def fold_bn_into(layer: nn.Module, bn: nn.modules.batchnorm._BatchNorm) -> nn.Module:
    """A copy of ``layer`` whose output equals ``bn(layer(x))`` for an eval-mode ``bn``."""
    fused = copy.deepcopy(layer)
    with torch.no_grad():
        inv_std = torch.rsqrt(bn.running_var + bn.eps)
        gamma = bn.weight if bn.affine else torch.ones_like(inv_std)
        beta = bn.bias if bn.affine else torch.zeros_like(inv_std)
        factor = gamma * inv_std
        shape = [-1] + [1] * (fused.weight.dim() - 1)
        fused.weight.copy_(fused.weight * factor.reshape(shape))
        bias = fused.bias if fused.bias is not None else torch.zeros_like(bn.running_mean)
        new_bias = (bias - bn.running_mean) * factor + beta
        fused.bias = nn.Parameter(new_bias)
    return fused


def _rank(node: fx.Node) -> int:
    meta = node.meta.get(_meta.TENSOR_META)
    return len(meta.shape) if meta is not None and hasattr(meta, "shape") else -1


def fold_batchnorm(gm: fx.GraphModule) -> fx.GraphModule:
    """Fold every eval-mode ``conv/linear -> batch_norm`` module pair of ``gm`` in place."""
    for bn_node in list(gm.graph.nodes):
        call = bn_node.meta.get(_meta.OP)
        if call is None or call.op != "batch_norm" or bn_node.op != "call_module":
            continue
        layer_node = bn_node.args[0]
        if not (isinstance(layer_node, fx.Node) and layer_node.op == "call_module" and len(layer_node.users) == 1):
            continue
        if layer_node.meta.get(_meta.OP) is None or layer_node.meta[_meta.OP].op not in _FOLDABLE:
            continue
        bn = gm.get_submodule(bn_node.target)
        layer = gm.get_submodule(layer_node.target)
        if bn.training or bn.running_mean is None or layer.weight.shape[0] != bn.num_features:
            continue
        if layer_node.meta[_meta.OP].op == "linear" and _rank(layer_node) != 2:
            continue  # batch norm normalises dim 1; a linear's features are the last dim: same only in 2-D
        parent_name, _, attr = layer_node.target.rpartition(".")
        parent = gm.get_submodule(parent_name) if parent_name else gm
        setattr(parent, attr, fold_bn_into(layer, bn))
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
