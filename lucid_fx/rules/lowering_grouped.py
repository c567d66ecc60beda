"""Lowering rule for grouped products (the table entry is in rules/lowering.py).

``grouped_mm(x, W, offs)`` multiplies the rows of each group of ``x`` (sorted by expert) by that
expert's (K, N) weight: Mixtral's experts, as transformers writes them (``torch._grouped_mm`` or its
``grouped_mm_fallback``). Where ``W`` is a parameter, or a transposed view of one (transformers
stores experts as (E, N, K) and passes ``W.transpose(-2, -1)``), it is quantized once here as a
linear's weight (with the QConfig's weight observer, as a linear's), (E, N, K) int8 with one scale
per (expert, output channel), and the product runs as ``lucid_fx::grouped_linear``: each expert's
rows on the device's int8 linear. A weight computed in the graph, a bias or another result dtype
declines (float).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx.ops import canonical
from lucid_fx.quantization.fake_quantize import FakeQuantize
from lucid_fx.quantization.weight import quantize_weight
from lucid_fx.rules.lowering_context import QValue

__all__ = ["lower_grouped_mm", "expert_weights", "quantized_experts"]

_LAST_TWO = ({-2, -1}, {1, 2})  # transpose(W, -2, -1) of an (E, N, K) parameter, as transformers writes it


def expert_weights(attr: Callable, weight: object) -> Optional[torch.Tensor]:
    """The (E, N, K) float weight behind a grouped product's (E, K, N) operand, a view of the
    parameter: the parameter itself (transposed here), or a transpose of its last two dims (the
    parameter as stored); else None. ``attr`` reads a get_attr node's tensor (None for other nodes)."""
    if not isinstance(weight, fx.Node):
        return None
    value = attr(weight)
    if value is not None:
        return value.detach().transpose(-2, -1) if value.dim() == 3 else None
    call = canonical(weight) if weight.op == "call_function" or weight.op == "call_method" else None
    if call is None or call.op != "transpose" or {call.args.get("dim0"), call.args.get("dim1")} not in _LAST_TWO:
        return None
    value = attr(call.args.get("input"))
    return value.detach() if value is not None and value.dim() == 3 else None


def quantized_experts(weight: torch.Tensor, weight_range, observer: Optional[nn.Module] = None) -> tuple:
    """(E, N, K) int8 codes and (E, N) scales of the (E, N, K) ``weight``, each expert's rows as a linear's
    weight, observed afresh by a copy of the QConfig's weight ``observer`` (prepare's, under the
    grouped product's ``WEIGHT_OBSERVER``; None: per output channel, min/max): what the kernel
    multiplies by, and the reference model too. A QAT fake quant's observer observes (the experts
    were not trained through it)."""
    if isinstance(observer, FakeQuantize):
        observer = observer.activation_post_process
    experts, n, k = weight.shape
    codes, scales = quantize_weight(weight.reshape(experts * n, k), observer, weight_range)
    return codes.reshape(experts, n, k).contiguous(), scales.reshape(experts, n).contiguous()


def lower_grouped_mm(ctx, members, resolve) -> Optional[QValue]:  # grouped_mm(x, W, offs) -> lucid_fx.grouped_linear
    node = members[0]
    call = canonical(node)
    x, offs = resolve(call.args.get("input")), resolve(call.args.get("offs"))
    weight = expert_weights(ctx.attr, resolve(call.args.get("weight")))
    if (not isinstance(x, fx.Node) or not ctx.has_quant(x) or weight is None or not isinstance(offs, fx.Node)
            or call.args.get("bias") is not None or call.args.get("out_dtype") is not None
            or ctx.qparams_of(node) is None):
        return None
    key = node.meta.get(_meta.WEIGHT_OBSERVER)
    observer = ctx.weight_observers[key] if key in ctx.weight_observers else None
    codes, scales = quantized_experts(weight, ctx.target.weight_range, observer)
    if ctx._may_overflow(node, codes.flatten(0, 1)):
        return None
    qw, ws = ctx.constant(f"{node.name}_qweight", codes), ctx.constant(f"{node.name}_wscale", scales)
    q = ctx.float_layout_of(x)  # rows as the float model has them
    scale, zp, _ = ctx.qparams_of(node)
    out = ctx.call(torch.ops.lucid_fx.grouped_linear, q.node, q.scale, q.zero_point, qw, ws, ctx.float_of(offs), scale, zp)
    return ctx.output_qvalue(node, out)
