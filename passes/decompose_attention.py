"""decompose_attention: ``F.scaled_dot_product_attention`` written out as the ops eager attention uses.

transformers' default attention (``attn_implementation="sdpa"``) is one call, which no int8 kernel
takes. Written out, it is what the "eager" attention of every transformers model computes, and
what lucid_fx already quantizes: ``softmax(q @ k.transpose(-2, -1) * scale + mask) @ v``, the two
matmuls in int8, the scores' scale a rescaled grid, the mask read exactly in float by the masked
softmax (docs/policies.md), the probabilities on softmax's fixed grid.

Runs after propagate_shapes (it reads the shapes of query and key: the default scale is
``1 / sqrt(E)``, grouped-query attention repeats key and value ``Hq / Hkv`` times) and records the
new nodes' shapes the same way. A call with ``dropout_p`` other than 0, or whose shapes are not
known, is left as it is (and runs in float). The last new node takes the call's name, so reports
and compare name the attention's output as before.

Reads ``node.meta["tensor_meta"]``. Writes ``tensor_meta`` and ``MODULE_PATH`` on the new nodes.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Optional

import torch
import torch.nn.functional as F
from torch import fx
from torch.fx.passes.shape_prop import TensorMetadata

from lucid_fx import _meta
from lucid_fx.passes._rewrite import recompiled, swap_in

__all__ = ["decompose_attention"]

_SDPA = F.scaled_dot_product_attention
_PARAMETERS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


def _bound(node: fx.Node) -> Optional[Dict[str, Any]]:
    if node.op != "call_function" or node.target is not _SDPA or len(node.args) > len(_PARAMETERS):
        return None
    args = dict(_DEFAULTS, **dict(zip(_PARAMETERS, node.args)), **node.kwargs)
    return args if set(args) == set(_PARAMETERS) else None


def _shape(value: Any) -> Optional[torch.Size]:
    meta = value.meta.get(_meta.TENSOR_META) if isinstance(value, fx.Node) else None
    return meta.shape if isinstance(meta, TensorMetadata) else None


def _dtype(value: Any) -> Optional[torch.dtype]:
    meta = value.meta.get(_meta.TENSOR_META) if isinstance(value, fx.Node) else None
    return meta.dtype if isinstance(meta, TensorMetadata) else None


def _write_out(graph: fx.Graph, node: fx.Node, a: Dict[str, Any]) -> Optional[fx.Node]:
    """The eager form of one attention call, inserted before it; None where it cannot be written."""
    q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
    qs, ks = _shape(q), _shape(k)
    if qs is None or ks is None or len(qs) < 2 or a["dropout_p"] not in (0, 0.0) or isinstance(a["scale"], fx.Node):
        return None
    if isinstance(mask, fx.Node) and _dtype(mask) is None:
        return None
    scale = a["scale"] if a["scale"] is not None else 1.0 / math.sqrt(qs[-1])
    call = graph.call_function
    if a["enable_gqa"] and len(qs) >= 3 and qs[-3] != ks[-3]:
        repeat = qs[-3] // ks[-3]
        k = graph.call_method("repeat_interleave", (k, repeat), {"dim": -3})
        v = graph.call_method("repeat_interleave", (v, repeat), {"dim": -3})
    scores = call(torch.mul, (call(torch.matmul, (q, graph.call_method("transpose", (k, -2, -1)))), float(scale)))
    if a["is_causal"]:
        keep = graph.call_method("tril", (call(torch.ones, (qs[-2], ks[-2]), {"dtype": torch.bool}),))
        scores = call(torch.masked_fill, (scores, call(torch.logical_not, (keep,)), float("-inf")))
    if isinstance(mask, fx.Node) and _dtype(mask) == torch.bool:
        scores = call(torch.masked_fill, (scores, call(torch.logical_not, (mask,)), float("-inf")))
    elif mask is not None:
        scores = call(torch.add, (scores, mask))
    return call(torch.matmul, (call(torch.softmax, (scores, -1)), v))


def decompose_attention(gm: fx.GraphModule, example_inputs: Optional[tuple] = None) -> fx.GraphModule:
    """Write out every ``scaled_dot_product_attention`` call of ``gm`` (in place) whose shapes
    propagate_shapes recorded; with ``example_inputs``, record the new nodes' shapes too."""
    changed = False
    for node in list(gm.graph.nodes):
        args = _bound(node)
        if args is None:
            continue
        with gm.graph.inserting_before(node):
            out = _write_out(gm.graph, node, args)
        if out is None:
            continue
        swap_in(gm, node, out)
        changed = True
    return recompiled(gm, example_inputs) if changed else gm
