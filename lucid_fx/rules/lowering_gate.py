"""Lowering rules for gates: activations computed on a linear's float result instead of its codes.

- ``tanh/sigmoid(linear(h))`` -> the linear with the activation as its post-op (:func:`lower_gate`);
- ``gate(linear(a)) * f(linear(b))``, each factor read only by the product, the gate a tanh or sigmoid
  (the gated MLP's ``tanh(v) * sigmoid(g)``, an LSTM-style cell) -> both linears give their float results,
  the product is taken in float and rounded once, onto the product's grid (:func:`lower_gate_product`).
  Not SwiGLU's ``silu(g) * u``: its factors' grids come from statistics, and removing their roundings
  measured nothing (the Llama-like family, 36.2 dB either way) while the float results cost time.

Called from the elementwise and binary rules of :data:`lucid_fx.rules.lowering.LOWERINGS`;
passes/insert_qdq.py (the reference) and passes/predict_placement.py ask the same predicates.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.ops import canonical
from lucid_fx.rules.lowering_context import QValue, readers, watched

__all__ = ["lower_gate", "gate_after_linear", "GATE_POST_OPS", "GATE_WHY", "lower_gate_product", "product_factor",
           "PRODUCT_WHY", "PRODUCT_OF"]

_ops = torch.ops.lucid_fx
#: Activations convert makes the post-op of the linear before them (computed in float after its float32 result).
GATE_POST_OPS = ("tanh", "sigmoid")
#: Why such a linear has no codes of its own (the convert report, explain).
GATE_WHY = "linear, its result read by {act} inside the kernel ({act} its post-op)"
_LINEARS = (_ops.linear, _ops.linear.default)


def gate_after_linear(value: fx.Node, reader: fx.Node) -> bool:
    """Whether ``reader`` is a tanh or sigmoid of ``value``, a plain linear (no group of its own) that
    nothing else reads: the pair :func:`lower_gate` runs as one kernel. passes/insert_qdq.py asks too."""
    return (_meta.OP in value.meta and _meta.OP in reader.meta and canonical(value).op == "linear"
            and value.meta.get(_meta.FUSED_INTO) is None and canonical(reader).op in GATE_POST_OPS
            and readers(value)[1] == [reader])


def _sigmoid_as_tanh(scale: float, zp: int, qdtype) -> Optional[Tuple[float, int]]:
    """The grid on which ``tanh(y / 2)``'s codes are ``sigmoid(y)``'s on ``(scale, zp)``, where there is one:
    ``sigmoid(y) / scale = (tanh(y / 2) + 1) * h`` with ``h = 1 / (2 scale)`` a whole number (the fixed
    grid 1/256: h = 128), so the codes are ``round(tanh(y / 2) * h) + h + zp``, clamped alike."""
    h = 1.0 / (2.0 * scale)
    if abs(h - round(h)) > 1e-9 * h or not qdtype.quant_min <= zp + round(h) <= qdtype.quant_max:
        return None
    return 1.0 / round(h), zp + round(h)


def lower_gate(ctx, node: fx.Node, source: fx.Node, x: QValue) -> Optional[QValue]:
    """``tanh/sigmoid(linear(h))`` -> ``lucid_fx.linear(post_op=tanh/sigmoid)`` on the activation's grid
    (fixed, or narrowed to what the linear's grid reaches: passes/narrow_fixed_grids.py), where the
    linear's codes are read by nothing else. Its own grid was then only an intermediate: the gated
    MLP's output 34.9 -> 36.2 dB SQNR. The linear stays observed, so the narrowing still sees its range.
    oneDNN has tanh as a post-op and no sigmoid: a sigmoid on its fixed grid is ``tanh`` of the linear
    on halved weight scales and bias (exact in float) on the grid of :func:`_sigmoid_as_tanh`, the same
    codes; on a narrowed grid it is the ``sigmoid`` post-op, computed after the float result."""
    lin, op = x.node, canonical(node).op
    if (lin.op != "call_function" or lin.target not in _LINEARS or lin.args[8] != "none" or lin.args[9] is not None
            or not gate_after_linear(source, node)):
        return None
    scale, zp, qdtype = ctx.qparams_of(node)
    if qdtype.storage != x.qdtype.storage:
        return None  # the linear writes codes of its input's dtype
    args, grid = list(lin.args[:6]), (scale, zp)
    half = _sigmoid_as_tanh(scale, zp, qdtype) if op == "sigmoid" else None
    if half is not None:
        ws, bias = ctx.attr(args[4]), ctx.attr(args[5])
        args[4] = ctx.constant(f"{node.name}_half_wscale", ws / 2)
        args[5] = None if bias is None else ctx.constant(f"{node.name}_half_bias", bias / 2)
        grid, op = half, "tanh"
    out = ctx.call(_ops.linear, *args, *grid, op, None)
    ctx.absorb(source.name, node, GATE_WHY.format(act=node.name))
    return ctx.output_qvalue(node, out)


#: Why a factor of a fused product has no codes of its own (the convert report, explain).
PRODUCT_WHY = "computed in float inside {mul}'s product (rounded once, on the product's grid)"
#: How the fused product itself runs (the convert report, explain).
PRODUCT_OF = "mul of its factors' float results, rounded once (rules/lowering_gate.py)"
#: The fused groups whose output a product may read in float: a linear and its post-op.
_LINEAR_GROUPS = ("linear_relu", "linear_act")


def _gate(value: fx.Node) -> bool:
    """Whether ``value`` (prepared) is a tanh or sigmoid that convert makes its linear's post-op."""
    return (_meta.OP in value.meta and canonical(value).op in GATE_POST_OPS
            and gate_after_linear(watched(canonical(value).tensor_inputs()[0]), value))


def _linear_result(value: fx.Node) -> bool:
    """Whether ``value`` (prepared) is a linear's result: a plain linear, a linear with its fused
    post-op, or a gate (:func:`_gate`)."""
    if _meta.OP not in value.meta:
        return False
    if value.meta.get(_meta.FUSED_INTO) is None:
        return canonical(value).op == "linear" or _gate(value)
    return value.meta[_meta.FUSED_INTO] == value.name and value.meta.get(_meta.FUSION) in _LINEAR_GROUPS


def product_factor(value: fx.Node, mul: fx.Node) -> bool:
    """Whether ``value`` (prepared) is a factor of ``mul`` that convert computes in float inside the
    product (:func:`lower_gate_product`): ``mul`` multiplies two linears' results, each read only by it,
    one of them a gate, whose fixed grid (1/128 over [-1, 1] for tanh) would round it."""
    if _meta.OP not in mul.meta or canonical(mul).op != "mul" or mul.meta.get(_meta.FUSED_INTO) is not None:
        return False
    factors = [watched(canonical(mul).args.get(k)) for k in ("input", "other")]
    return (value in factors and all(isinstance(f, fx.Node) and readers(f)[1] == [mul] and _linear_result(f)
                                     for f in factors) and any(_gate(f) for f in factors))


def _float_factor(ctx, mul: fx.Node, value: Any, codes: QValue) -> Optional[Tuple[fx.Node, bool]]:
    """The float result of the linear giving ``codes`` (``value``'s), and whether it is a sigmoid's
    ``tanh(y / 2)`` (:func:`_sigmoid_as_tanh`); None where the product cannot read it in float."""
    lin = codes.node
    if (not isinstance(value, fx.Node) or lin.op != "call_function" or lin.target not in _LINEARS
            or lin.args[9] is not None or not product_factor(value, mul)):
        return None
    post_op = lin.args[8]
    halved = canonical(value).op == "sigmoid" and post_op == "tanh"
    return ctx.call(_ops.linear, *lin.args[:6], 1.0, 0, post_op, torch.float32), halved


def lower_gate_product(ctx, mul: fx.Node, a: Any, b: Any, qa: QValue, qb: QValue) -> Optional[QValue]:
    """``f(linear(x)) * g(linear(y))`` -> both linears' float results (post-ops inside oneDNN), their
    product in float, one rounding onto the product's grid, where only the product reads each factor.
    Their own grids were then only intermediates: the gated MLP's tanh and sigmoid codes rounded twice
    before the product rounded a third time (its output 36.1 -> 36.7 dB SQNR, benchmarks/int8_inference.py).
    A sigmoid on its fixed grid arrives as ``t = tanh(y / 2)`` (sigmoid = (1 + t) / 2): ``f * (1 + t)`` is
    one ``addcmul``, the halving goes into the grid. None leaves the product to the int8 kernel."""
    fa = _float_factor(ctx, mul, a, qa)
    fb = fa if b is a else _float_factor(ctx, mul, b, qb)  # x * x: one float linear
    if fa is None or fb is None or (fa[1] and fb[1]):
        return None
    scale, zp, qdtype = ctx.qparams_of(mul)
    (x, _), (t, halved) = (fb, fa) if fa[1] else (fa, fb)
    if halved:
        product, scale = ctx.call(torch.addcmul, x, x, t), 2.0 * scale
    else:
        product = ctx.call(torch.mul, x, t)
    out = ctx.call(_ops.quantize_per_tensor, product, scale, zp, qdtype.quant_min, qdtype.quant_max, qdtype.storage)
    for value in {a, b}:
        ctx.absorb(value.name, mul, PRODUCT_WHY.format(mul=mul.name))
    ctx.absorb(mul.name, mul, PRODUCT_OF)  # not lucid_fx.mul on codes: the report says how it runs
    return QValue(out, ctx.qparams_of(mul)[0], zp, qdtype)
