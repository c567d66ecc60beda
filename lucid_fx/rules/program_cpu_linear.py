"""Program rules for the CPU's linears: ``lucid_fx::linear`` on oneDNN's prepacked linear (a 1x1
convolution where that is faster), on lucid_fx's row engines (:mod:`lucid_fx.kernels.linear_row`), or
with a float residual add fused in as oneDNN's "add" post-op; the helpers the convolution rules
(:mod:`lucid_fx.rules.program_cpu`) share with them.
"""

from __future__ import annotations

import operator
from typing import Callable, Dict, Optional

import torch
from torch import fx

from lucid_fx.kernels import cpu as onednn
from lucid_fx.kernels import native, program_ops
from lucid_fx.kernels.linear_native import ADDEND
from lucid_fx.kernels.linear_row import (float_post_op, linear_row, row_bounds, row_linear, row_out_scale,
                                         takes_row)
from lucid_fx.kernels.native import post_op_codes
from lucid_fx.kernels.pointwise_rows import pointwise_rows
from lucid_fx.kernels.reference import ONEDNN_CONV_POST_OPS, onednn_post_op
from lucid_fx.kernels.row_plan import planned_rows, planned_rows_add, planned_step
from lucid_fx.kernels.zero_point import signed_zero_point_bias, to_signed

__all__ = ["PROGRAM_RULES_CPU_LINEAR"]

ON = torch.ops.onednn


def _weights(b, node: fx.Node, qw_node, ws_node, bias_node, groups: int = 1):
    """(int8 weight, float32 scales, bias) of a linear or conv (in ``groups`` groups), or None where
    oneDNN would not be exact here."""
    qw = b.attr(qw_node)
    if qw is None or not onednn.onednn_available() or not onednn._exact_on_onednn(qw, groups):
        return None
    ws = b.attr(ws_node)
    return qw, ws.to(torch.float32), b.attr(bias_node)


def _out_args(out_scale: float, out_zp: int, dtype: torch.dtype):
    """oneDNN's (output scale, zero point, dtype) for a uint8 or float32 result."""
    return (1.0, 0, torch.float32) if dtype == torch.float32 else (out_scale, out_zp, None)


def linear(b, node):  # lucid_fx.linear -> onednn.qlinear_pointwise (VNNI) or a 1x1 qconv2d (AVX2) on a packed weight
    post_op, dtype, qw = node.args[8], b.value(node).dtype, b.attr(node.args[3])
    mnk = None if qw is None else (b.value(node.args[0]).numel() // qw.shape[1], *qw.shape)
    if not float_post_op(onednn._cpu_target(), onednn._onednn_on(), post_op, dtype, mnk):
        return _linear(b, node, post_op, dtype)
    y = _linear(b, node, "none", torch.float32)  # SiLU without VNNI: after the float result, as cpu.linear
    return None if y is None else b.call(post_op_codes, y, post_op, node.args[6], node.args[7], dtype)


def _linear(b, node, post_op: str, dtype: torch.dtype):
    """The linear of ``node`` with this post-op and result dtype (``node``'s, or float32 for a post-op after it)."""
    qx, x_scale, x_zp, qw_n, ws_n, bias_n, out_scale, out_zp, _, out_dtype = node.args
    x = b.value(qx)
    if x.dtype != torch.uint8 or dtype not in (torch.uint8, torch.float32) or x.numel() == 0:
        return None
    qw = b.attr(qw_n)
    engine = None if qw is None else _engine(post_op, dtype, x.numel() // qw.shape[1], *qw.shape)
    out = None if engine is None else _linear_row(b, node, qx, x_scale, x_zp, qw, b.attr(ws_n), b.attr(bias_n),
                                                  out_scale, out_zp, post_op, engine, dtype=dtype,
                                                  residual=_residual_add(b, node, post_op, dtype))
    if out is not None:
        return out
    weights = _weights(b, node, qw_n, ws_n, bias_n)
    if weights is None:
        return None
    qw, ws, bias = weights
    n, k = qw.shape
    zp, bias = onednn._folded_zero_point(qw, ws, bias, x_scale, x_zp)
    signed = None if onednn._zero_point_exact_on_onednn(qw, zp) else signed_zero_point_bias(qw, ws, bias, x_scale, zp)
    if signed is None and not onednn._zero_point_exact_on_onednn(qw, zp):
        return None
    rows = qx if x.dim() == 2 else b.call_method("reshape", qx, (-1, k))
    if not x.is_contiguous():  # a slice such as h[:, 0]: the routes below read dense rows
        rows = b.call_method("contiguous", rows)
    m = x.numel() // k
    scale, ozp, odtype = _out_args(out_scale, out_zp, dtype)
    if signed is not None:  # int8 codes, their zero point in the bias (AMX: cpu.linear's route), a uint8 result asked for
        rows, zp, bias, odtype = _signed_rows(b, rows, qx, zp), 0, signed, dtype
    bias_c = None if bias is None else b.const(bias.to(torch.float32), "bias")
    zeros = b.const(torch.zeros(n, dtype=torch.int64), "wzp")
    if onednn._linear_as_conv() and zp == 0 and signed is None and post_op in ONEDNN_CONV_POST_OPS:
        # (M, K) row-major codes are a (1, K, 1, M) channels-last image; the (1, N, 1, M) channels-last
        # result is the (M, N) output: no copy either way (1.1-2.2x faster than the linear without VNNI).
        packed = ON.qconv_prepack(qw.contiguous().view(n, k, 1, 1), ws, 1.0, 0, [1, 1], [0, 0], [1, 1], 1, None)
        image = b.call_method("as_strided", rows, (1, k, 1, m), (m * k, 1, m * k, k))
        out = b.call(ON.qconv2d_pointwise.default, image, x_scale, 0, b.const(packed, "packed"), b.const(ws, "wscale"),
                     zeros, bias_c, [1, 1], [0, 0], [1, 1], 1, scale, ozp, odtype, *onednn_post_op(post_op))
        out = b.call_method("reshape", b.call_method("permute", out, (0, 2, 3, 1)), tuple(b.value(node).shape))
        return out
    packed = ON.qlinear_prepack(qw.contiguous(), None)
    residual = _residual_add(b, node, post_op, dtype)
    if residual is not None:  # linear(x) + r in float: oneDNN's "add" post-op, the same float32 sum
        add, other = residual
        out = b.call(ON.qlinear_pointwise.binary, rows, x_scale, zp, b.const(packed, "packed"), b.const(ws, "wscale"),
                     zeros, b.call_method("reshape", other, (-1, n)), bias_c, 1.0, 0, torch.float32, 1.0, 0, "add", 1.0,
                     "none", [], "")
        out = out if x.dim() == 2 else b.call_method("view", out, tuple(b.value(node).shape))
        add.replace_all_uses_with(out)  # the add is left without users: dead code at the rewrite's end
        return out
    out = b.call(ON.qlinear_pointwise.default, rows, x_scale, zp, b.const(packed, "packed"), b.const(ws, "wscale"),
                 zeros, bias_c, scale, ozp, odtype, *onednn_post_op(post_op))
    return out if x.dim() == 2 else b.call_method("view", out, tuple(b.value(node).shape))


def _signed_rows(b, rows, qx, zp_u8: int):
    """uint8 codes ``rows`` (of ``qx``, zero point ``zp_u8``) as int8 codes: written so by the quantize that makes
    them where nothing else reads its codes (the float boundary in one pass, 30 us less for the batch-64 MLP's
    first layer on an AMX Xeon than a quantize and a pass over its codes), else :func:`to_signed`."""
    quantizes = (native.quantize_codes, program_ops.quantize_codes)
    if (rows is qx and b.op_name(qx) == "quantize_per_tensor" and qx.target in quantizes and len(qx.users) == 1
            and tuple(qx.args[2:6]) == (zp_u8, 0, 255, torch.uint8) and not qx.kwargs):
        return b.call(qx.target, qx.args[0], qx.args[1], zp_u8 - 128, -128, 127, torch.int8)
    return b.call(to_signed, rows)


_FLOAT_ADDS = (torch.add, operator.add)


def _residual_add(b, node, post_op: str, dtype: torch.dtype):
    """(add, r) where the float32 result of linear ``node`` is read once, by ``add = linear + r`` (or
    ``r + linear``) of a float32 ``r`` of its shape computed before it (a residual connection), else
    None. oneDNN's "add" post-op then writes the sum: one float32 addition, as torch.add's (equal on
    every value of a 1024 x 256 product measured, and in the tests), without the float result's own pass."""
    users = [u for u in node.users if u.users]
    if post_op != "none" or dtype != torch.float32 or b.value(node).dtype != torch.float32 or len(users) != 1:
        return None
    add = users[0]
    if add.op != "call_function" or add.target not in _FLOAT_ADDS or add.kwargs or len(add.args) != 2:
        return None
    other = add.args[1] if add.args[0] is node else add.args[0]
    r, out = b.value(other), b.value(node)
    if (other is node or not isinstance(other, fx.Node) or not isinstance(r, torch.Tensor) or r.dtype != torch.float32
            or r.shape != out.shape or not r.is_contiguous() or not b.defined_before(other, node)):
        return None
    return add, other


def _engine(post_op: str, dtype: torch.dtype, m: int, n: int, k: int, pointwise: bool = False) -> Optional[str]:
    """The engine an (m, k) by (k, n) linear (a 1x1 convolution's: ``pointwise``) takes off oneDNN
    (linear_row.takes_row), or None."""
    return takes_row(onednn._cpu_target(), onednn._onednn_on(), post_op, dtype, m, n, k, pointwise)


def _linear_row(b, node, qx, x_scale, x_zp, qw2d, ws, bias, out_scale, out_zp, post_op, engine, rows=None, dtype=None,
                pointwise=False, steps=None, residual=None):
    """One row (batch 1, or a 1x1 image) or a small linear (linear_row.small_gemm): linear_row on
    ``engine`` with oneDNN's float steps; None where the engine does not take the weight. ``pointwise``:
    a 1x1 convolution of stride 1 of channels-last ``qx``, its pixels the rows (pointwise_rows.pointwise_rows).
    ``residual``: :func:`_residual_add`'s (add, r), r then added in the GEMM's float steps (linear_add.py).
    The program owns a copy of the weight, as it owns oneDNN's packed one: an edit in place reaches it
    only through ``recompile`` (which rebuilds the folded bias too)."""
    dtype = dtype or b.value(node).dtype
    m = b.value(node).numel() // qw2d.shape[0]  # the output's rows (an image's pixels)
    kept = row_linear(qw2d.clone(), ws, bias, x_scale, x_zp, row_out_scale(out_scale, dtype), engine, post_op, m, steps)
    if kept is None:
        return None
    row = b.const(kept, "row")
    if pointwise:
        return b.call(pointwise_rows, qx, row, out_zp, *row_bounds(dtype, out_zp, post_op), dtype)
    if rows is not None:  # rows the caller laid out (a patchify convolution's): (M, N) back to it
        return b.call(linear_row, rows, row, out_zp, *row_bounds(dtype, out_zp, post_op), dtype)
    low, high = row_bounds(dtype, out_zp, post_op)
    if residual is not None:  # linear(x) + r: in the GEMM, the same float32 sum
        add, other = residual
        step = planned_step(b.value(qx), kept, 0, low, high, dtype, ADDEND)
        out = b.call(planned_rows_add, qx, other, row, None if step is None else b.const(step, "gemm"), low, high)
        add.replace_all_uses_with(out)  # the add is left without users: dead code at the rewrite's end
        return out
    # rows of any rank (a transformer's (batch, seq, K)) in one call, without a reshape and a view, the GEMM's call
    # bound once (row_plan.py)
    step = planned_step(b.value(qx), kept, out_zp, low, high, dtype)
    return b.call(planned_rows, qx, row, None if step is None else b.const(step, "gemm"), out_zp, low, high, dtype)


PROGRAM_RULES_CPU_LINEAR: Dict[str, Callable[..., Optional[fx.Node]]] = {
    "linear": linear,  # lucid_fx.linear -> onednn.qlinear_pointwise / 1x1 qconv2d_pointwise, packed once; rows: linear_row
}
