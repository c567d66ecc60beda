"""Lowering rules for attention's masked softmax (the table entries are in rules/lowering.py).

``softmax(s.masked_fill(m, v))`` and ``softmax(s + m)``, fused at prepare as ``masked_softmax``
(rules/fusions.py), become ``lucid_fx.masked_softmax``: the scores ``s`` as int8 codes on the grid
their own observer chose from the unmasked values, the mask ``m`` in float exactly as the float
model reads it (rules/masks.py says which operand it is). docs/policies.md, "Attention masks".
"""

from __future__ import annotations

import math
from typing import Any, List, Optional

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.rules.lowering_context import QValue, readers
from lucid_fx.ops import canonical
from lucid_fx.rules.masks import MASKED_SOFTMAX, mask_input, scores_input
from lucid_fx.rules.observers import DecisionKind

__all__ = ["lower_masked_softmax", "unfused_mask", "holds_mask_values", "MASK_THRESHOLD", "softmax_read_only_by",
           "lower_softmax_matmul", "FUSED_SOFTMAX"]

_ops = torch.ops.lucid_fx


#: Activation values at or below this are mask values (BERT's -10000.0, -1e9, finfo.min), as are
#: -inf and NaN: an 8-bit grid that holds one of them has no room left for the scores beside it.
MASK_THRESHOLD = -1e4
HOLDS_MASK = "held mask values (-inf, or <= -1e4) at calibration, which int8 codes cannot hold: runs in float, exactly"


def holds_mask_values(observers: Any, node: Any) -> bool:
    """Whether the observer of ``node`` (in ``observers``, the prepared model's ``lucid_fx_observers``)
    saw -inf/NaN, which it skipped, or values <= MASK_THRESHOLD."""
    key = node.meta.get(_meta.OBSERVER) if isinstance(node, fx.Node) else None
    observer = observers[key] if key is not None and key in observers else None
    observer = getattr(observer, "activation_post_process", observer)  # a FakeQuantize's observer
    low = getattr(observer, "min_val", None)
    if int(getattr(observer, "nonfinite_count", 0)) > 0:
        return True
    return isinstance(low, torch.Tensor) and low.numel() > 0 and bool((low <= MASK_THRESHOLD).any())


def unfused_mask(observers: Any, members: List[fx.Node]) -> Optional[str]:
    """Why a softmax, an add of two tensors, a masked softmax group or an op on its input's codes (a row's
    max) runs in float because a mask reached it unfused (its masked_fill or add has other users, or it was
    masked twice), or None. Read by their lowering rules and by passes/predict_placement.py."""
    ops = tuple(canonical(m).op for m in members)
    decision = members[0].meta.get(_meta.DECISION)
    if getattr(decision, "kind", None) is DecisionKind.SHARED and holds_mask_values(observers, members[0]):
        return "its input " + HOLDS_MASK  # the observer it shares with its input
    call = canonical(members[0])
    if ops == ("softmax",) and holds_mask_values(observers, call.args.get("input")):
        return "its input " + HOLDS_MASK
    if members[0].meta.get(_meta.FUSION) == MASKED_SOFTMAX and holds_mask_values(observers, scores_input(members[0])):
        return "its scores " + HOLDS_MASK  # masked before: s + a + b, GPT-2's where(c, s, finfo.min) + a
    two_tensors = all(isinstance(call.args.get(k), fx.Node) for k in ("input", "other"))
    if ops[0] == "add" and two_tensors and holds_mask_values(observers, members[-1]):
        return "its output " + HOLDS_MASK
    return None



def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def lower_masked_softmax(ctx, members, resolve):  # softmax(s masked by m) -> lucid_fx.masked_softmax
    masked, soft = members
    call, dim = canonical(masked), canonical(soft).args.get("dim")
    scores, mask = resolve(scores_input(masked)), resolve(mask_input(masked))
    unfused = unfused_mask(ctx.observers, members)
    if unfused:
        ctx.declined[soft.name] = unfused
        return None
    x = ctx.quant_or_none(scores)
    if x is None or not isinstance(dim, int) or ctx.qparams_of(soft) is None or call.args.get("alpha", 1) != 1:
        return None
    scale, zp, _ = ctx.qparams_of(soft)
    if call.op == "add" and mask is None:  # s + c, c a number: softmax ignores a constant shift
        c = call.args.get("other") if isinstance(call.args.get("input"), fx.Node) else call.args.get("input")
        if not (_number(c) and math.isfinite(c)):
            return None
        return ctx.output_qvalue(soft, ctx.call(_ops.softmax, x.node, x.scale, x.zero_point, dim, scale, zp))
    fill = call.args.get("value") if call.op == "masked_fill" else None
    if mask is None or (call.op == "masked_fill" and not _number(fill)):
        return None  # a fill value computed in the graph: the group runs in float
    fill = None if fill is None else float(fill)
    out = ctx.call(_ops.masked_softmax, x.node, x.scale, x.zero_point, ctx.float_of(mask), fill, dim, scale, zp)
    return ctx.output_qvalue(soft, out)


#: Why a softmax fused into its matmul has no value of its own (the convert report, explain).
FUSED_SOFTMAX = ("fused into {matmul}'s softmax_matmul: the probabilities on each row's own grid, "
                 "not the softmax's fixed one (lucid_fx/kernels/softmax_matmul.py)")
_SOFTMAXES = (_ops.softmax, _ops.softmax.default, _ops.masked_softmax, _ops.masked_softmax.default)


def softmax_read_only_by(value: fx.Node, matmul: fx.Node) -> bool:
    """Whether ``value``, a prepared node, is a softmax along its last dim whose every reader, through
    its observers, is ``matmul``'s left operand: the pair convert fuses (:func:`lower_softmax_matmul`)."""
    if _meta.OP not in value.meta or canonical(value).op != "softmax" or _meta.OP not in matmul.meta:
        return False
    shape = getattr(value.meta.get("tensor_meta"), "shape", None)
    dim = canonical(value).args.get("dim")
    if not isinstance(dim, int) or not (dim == -1 or (shape is not None and dim == len(shape) - 1)):
        return False
    call = canonical(matmul)
    if call.op != "matmul":
        return False
    aliases, reads = readers(value)
    return reads == [matmul] and call.args.get("input") in aliases and call.args.get("other") not in aliases


def lower_softmax_matmul(ctx, matmul: fx.Node, a: QValue, b: QValue, source: fx.Node) -> Optional[QValue]:
    """``softmax(s) @ v`` -> ``lucid_fx.softmax_matmul`` where the softmax (``source``, prepared; ``a``, its
    lowered codes) is read only by this matmul's left operand; None leaves the two ops as they are."""
    soft = a.node
    if soft.op != "call_function" or soft.target not in _SOFTMAXES or not softmax_read_only_by(source, matmul):
        return None
    scale, zp, qdtype = ctx.qparams_of(matmul)
    if qdtype.storage != b.qdtype.storage:
        return None  # codes of the values' dtype come out
    if soft.target in (_ops.softmax, _ops.softmax.default):
        q, q_scale, q_zp = soft.args[:3]
        mask, fill = None, None
    else:
        q, q_scale, q_zp, mask, fill = soft.args[:5]
    out = ctx.call(_ops.softmax_matmul, q, q_scale, q_zp, mask, fill, b.node, b.scale, b.zero_point, scale, zp)
    ctx.absorb(source.name, matmul, FUSED_SOFTMAX.format(matmul=matmul.name))
    return ctx.output_qvalue(matmul, out)
