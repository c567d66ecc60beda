"""Lowering rule for embedding (the table entry is in rules/lowering.py).

An embedding is a row lookup: quantize the whole table once, at convert, onto the output's
calibrated grid, and the lookup then reads codes (``F.embedding(ids, codes)``): no kernel of its
own, exact to the grid, a quarter of the table's memory. Rows calibration never looked up are
clamped to that grid like any other value outside it.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx.ops import canonical
from lucid_fx.rules.lowering_context import QValue

__all__ = ["lower_embedding"]


def _table(ctx, node: fx.Node):
    """(weight, padding_idx) of an embedding module or a call on a constant table; None for what
    changes the table (``max_norm`` renormalises rows in place) or a table computed in the graph."""
    if node.op == "call_module":
        m = ctx.prepared.get_submodule(node.target)
        return (m.weight, m.padding_idx) if m.max_norm is None else None
    call = canonical(node)
    weight = call.args.get("weight")
    table = ctx.attr(weight) if isinstance(weight, fx.Node) else None
    extra = {k: v for k, v in node.kwargs.items() if k not in ("input", "weight", "padding_idx")}
    if table is None or len(node.args) > 3 or any(v not in (None, False, 2.0) for v in extra.values()):
        return None
    padding = node.args[2] if len(node.args) > 2 else node.kwargs.get("padding_idx")
    return table, padding


def lower_embedding(ctx, members, resolve) -> Optional[QValue]:  # embedding(ids, W) -> F.embedding(ids, codes of W)
    node = members[0]
    ids = resolve(canonical(node).args.get("input"))
    found = _table(ctx, node)
    if found is None or ctx.qparams_of(node) is None:
        return None
    weight, padding_idx = found
    scale, zp, qdtype = ctx.qparams_of(node)
    codes = torch.ops.lucid_fx.quantize_per_tensor(
        weight.detach().float(), scale, zp, qdtype.quant_min, qdtype.quant_max, qdtype.storage
    )
    table = ctx.constant(f"{node.name}_codes", codes)
    out = ctx.graph.call_function(F.embedding, (ctx.float_of(ids), table, padding_idx))
    return QValue(out, scale, zp, qdtype)
