"""Program rules for the CPU: each portable ``lucid_fx::*`` call becomes the CPU's own calls, decided once.

A rule ``rule(b, node) -> fx.Node | None`` gets the :class:`~lucid_fx.passes.lower_to_program.ProgramBuilder`
and a call of the portable graph; it returns the node that computes the same value in the program, or
None to decline (the builder then calls the op's CPU kernel function directly). Every decision the
run-time kernels of :mod:`lucid_fx.kernels.cpu` take per call (weight packing, where the activation
zero point goes, the linear's route, the layout) is taken here once, with the same helpers, so the
program computes the same codes.
"""

from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch
from torch import fx

from lucid_fx.kernels import cpu as onednn
from lucid_fx.kernels import (conv_native, cpu_float, linear_native, linear_row, matmul_native, native,
                              native_elementwise, native_squeeze_excite, program_ops, softmax_native)
from lucid_fx.kernels import softmax_matmul as attention_rows
from lucid_fx.kernels.linear_row import (ROW_POST_OPS, conv_is_row,
                                         row_bounds, row_linear, row_out_scale)
from lucid_fx.kernels.pointwise_rows import pointwise_rows, pointwise_rows_plan, pointwise_rows_sum, pointwise_rows_sum_plan
from lucid_fx.kernels.onednn_check import conv_agrees
from lucid_fx.kernels.reference import onednn_post_op
from lucid_fx.rules.program_cpu_elementwise import PROGRAM_RULES_CPU_ELEMENTWISE
from lucid_fx.rules.program_cpu_elementwise import step as _step
from lucid_fx.rules.program_cpu_linear import PROGRAM_RULES_CPU_LINEAR, _engine, _linear_row, _out_args, _weights
from lucid_fx.rules.program_cpu_pool import PROGRAM_RULES_CPU_POOL

__all__ = ["PROGRAM_RULES_CPU"]

ON = torch.ops.onednn


def _is_patchify(x, qw, stride, padding, dilation, groups, engine) -> bool:
    """A convolution whose kernel tiles the image (ViT's patch embedding: stride = kernel, unpadded):
    a linear over the non-overlapping patches, whose rows are a reshape of channels-last codes. A 1x1
    convolution only on lucid_fx's GEMM (conv_native.native_engine): on ``_int_mm`` it was measured slower than
    oneDNN's inside models whose rows run to thousands (MobileNetV2-like 3.44 against 3.00 ms)."""
    kh, kw = qw.shape[2:]
    return (x.dim() == 4 and groups == 1 and (kh * kw > 1 or conv_native.native_engine(engine)) and list(stride) == [kh, kw]
            and not any(padding) and list(dilation) == [1, 1] and x.shape[2] % kh == 0 and x.shape[3] % kw == 0
            and x.is_contiguous(memory_format=torch.channels_last))


def _patch_linear(b, node, qx, x_scale, x_zp, qw, ws, bias, out_scale, out_zp, post_op, engine, steps=None):
    """A patchify convolution as linear_row on the patches, (kh, kw, C) per row as the weight is permuted."""
    n, c, h, w = b.value(qx).shape
    kh, kw = qw.shape[2:]
    if kh == kw == 1:  # a pixel a row, read in place
        return _linear_row(b, node, qx, x_scale, x_zp, qw.flatten(1), ws, bias, out_scale, out_zp, post_op, engine,
                           pointwise=True, steps=steps)
    nhwc = b.call_method("permute", qx, (0, 2, 3, 1))  # the channels-last codes as they lie
    tiles = b.call_method("permute", b.call_method("view", nhwc, (n, h // kh, kh, w // kw, kw, c)), (0, 1, 3, 2, 4, 5))
    rows = b.call_method("reshape", tiles, (-1, kh * kw * c))
    weight = qw.permute(0, 2, 3, 1).reshape(qw.shape[0], -1)
    out = _linear_row(b, node, qx, x_scale, x_zp, weight, ws, bias, out_scale, out_zp, post_op, engine, rows=rows,
                      steps=steps)
    if out is None:
        return None
    grid = b.call_method("view", out, (n, h // kh, w // kw, qw.shape[0]))
    return b.call_method("permute", grid, (0, 3, 1, 2))  # channels-last, as oneDNN's convolution returns it


def _native_conv(b, qx, x_scale, x_zp, qw, ws, bias, stride, padding, dilation, groups, out_scale, out_zp, post_op,
                 engine, dtype):
    """A convolution into ``dtype`` on lucid_fx's own kernels (kernels/conv_native.py: oneDNN's values, without its
    ~50-70 us a call on CPUs without VNNI); None where they do not take the weight or the layout."""
    x = b.value(qx)
    if not x.is_contiguous(memory_format=torch.channels_last):
        return None
    conv = conv_native.native_conv(qw, ws, bias, x_scale, x_zp, padding, groups, row_out_scale(out_scale, dtype), post_op,
                                   engine)
    if conv is None:
        return None
    return b.call(conv_native.conv_codes, qx, b.const(conv, "conv"), list(stride), list(padding), list(dilation), x_zp,
                  out_zp, *row_bounds(dtype, out_zp, post_op), dtype)


def _conv_args(b, node, qx, qw_n, ws_n, bias_n, x_scale, x_zp, stride, padding, dilation, groups):
    x = b.value(qx)
    weights = _weights(b, node, qw_n, ws_n, bias_n, groups)
    if weights is None or x.dtype != torch.uint8 or x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last):
        return None
    qw, ws, bias = weights
    zp, bias = onednn._unpadded_zero_point(qw, ws, bias, x_scale, x_zp, padding)
    # Packed for the input shape it meets, the weight takes oneDNN's best layout for it (0.83 against
    # 1.29 ms for 512 -> 512 channels 3x3 on 7x7, measured); a program is built per input shape.
    packed = ON.qconv_prepack(qw.contiguous(), ws, 1.0, 0, stride, padding, dilation, groups, list(x.shape))
    if not conv_agrees(packed, qw, ws, x.shape, stride, padding, dilation, groups):
        return None  # oneDNN's AMX kernels compute this convolution wrong: the portable call's exact fallback runs it
    return [qx, x_scale, zp, b.const(packed, "packed"), b.const(ws, "wscale"),
            b.const(torch.zeros(qw.shape[0], dtype=torch.int64), "wzp")], bias


def conv2d(b, node):  # lucid_fx.conv2d on channels-last uint8 codes -> onednn.qconv2d_pointwise on a packed weight
    post_op, dtype, qx, qw = node.args[12], b.value(node).dtype, node.args[0], b.attr(node.args[3])
    stride, padding, dilation, groups = node.args[6:10]
    if qw is None or not conv_native.post_op_after_float(onednn._cpu_target(), onednn._onednn_on(), post_op, dtype,
                                                         b.value(qx).shape, qw, groups, stride, padding, dilation):
        return _conv2d(b, node, post_op, dtype)
    y = _conv2d(b, node, "none", torch.float32)  # the post-op after the float result, as cpu._conv
    return None if y is None else b.call(native.post_op_codes, y, post_op, node.args[10], node.args[11], dtype)


def _conv2d(b, node, post_op: str, dtype: torch.dtype):
    """The convolution of ``node`` with this post-op and result dtype (``node``'s, or float32 for a post-op after it)."""
    qx, x_scale, x_zp, qw_n, ws_n, bias_n, stride, padding, dilation, groups, out_scale, out_zp, _, out_dtype = node.args
    x, qw = b.value(qx), b.attr(qw_n)
    engine = steps = None
    if qw is not None and x.dtype == torch.uint8 and x.dim() == 4:  # an (pixels, taps * c) by (taps * c, cout) product
        pixels = x.shape[0] * math.prod(conv_native.out_size(*x.shape[2:], qw.shape[2:], stride, padding, dilation))
        pointwise = tuple(qw.shape[2:]) == (1, 1) and groups == 1  # a GEMM over the pixels
        engine = _engine(post_op, dtype, pixels, qw.shape[0], qw[0].numel(), pointwise)
        if engine is None:  # an AMX CPU: where oneDNN runs this convolution on its VNNI kernels
            engine, steps = conv_native.amx_conv_engine(onednn._cpu_target(), onednn._onednn_on(), x.shape, qw, stride,
                                                        padding, dilation, groups, post_op, dtype, pixels, pointwise)
    out = None
    if engine is not None and conv_is_row(x.shape, qw.shape, padding, groups):  # squeeze-excite: a linear of one row
        out = _linear_row(b, node, qx, x_scale, x_zp, qw.flatten(1), b.attr(ws_n), b.attr(bias_n), out_scale, out_zp,
                          post_op, engine, dtype=dtype, pointwise=True, steps=steps)
    elif engine is not None and _is_patchify(x, qw, stride, padding, dilation, groups, engine):  # ViT's patch embedding
        out = _patch_linear(b, node, qx, x_scale, x_zp, qw, b.attr(ws_n), b.attr(bias_n), out_scale, out_zp, post_op,
                            engine, steps)
    elif conv_native.native_engine(engine) and conv_native.takes_conv(x.shape, qw, groups, stride, padding, dilation, engine):
        out = _native_conv(b, qx, x_scale, x_zp, qw, b.attr(ws_n), b.attr(bias_n), stride, padding, dilation,
                           groups, out_scale, out_zp, post_op, engine, dtype)
    if out is not None:
        return out
    found = _conv_args(b, node, qx, qw_n, ws_n, bias_n, x_scale, x_zp, stride, padding, dilation, groups)
    if found is None or dtype not in (torch.uint8, torch.float32):
        return None
    head, bias = found
    bias_c = None if bias is None else b.const(bias, "bias")
    return b.call(ON.qconv2d_pointwise.default, *head, bias_c, stride, padding, dilation, groups,
                  *_out_args(out_scale, out_zp, dtype), *onednn_post_op(post_op))


def conv2d_add(b, node):  # post(conv(x) + y) -> onednn.qconv2d_pointwise.binary "sum" into y's codes
    (qx, x_scale, x_zp, qw_n, ws_n, bias_n, stride, padding, dilation, groups, qother, o_scale, o_zp, out_scale,
     out_zp, post_op, out_dtype) = node.args
    other, out = b.value(qother), b.value(node)
    if out.dtype != torch.uint8 or other.dtype != torch.uint8 or other.shape != out.shape:
        return None
    pointwise = _pointwise_add(b, node)
    if pointwise is not None:
        return pointwise
    found = _conv_args(b, node, qx, qw_n, ws_n, bias_n, x_scale, x_zp, stride, padding, dilation, groups)
    if found is None:
        return None
    head, bias = found
    # oneDNN writes the sum into the residual's channels-last codes: copy them only if anything reads them later.
    accum = qother
    if b.read_later(qother, node) or not other.is_contiguous(memory_format=torch.channels_last):
        accum = b.call_method("clone", qother, memory_format=torch.channels_last)
    bias_c = None if bias is None else b.const(bias, "bias")
    return b.call(ON.qconv2d_pointwise.binary, head[0], *head[1:], accum, bias_c, stride, padding, dilation, groups,
                  out_scale, out_zp, None, o_scale, o_zp, "sum", 1.0, *onednn_post_op(post_op))


def _pointwise_add(b, node):
    """A 1x1 convolution of stride 1 plus a residual (a projection's shortcut) on lucid_fx's GEMM, where
    its engine takes the convolution: pointwise_rows.pointwise_rows_sum, oneDNN's codes (its "sum" post-op's
    arithmetic, measured equal on 30M outputs of its VNNI kernels and 30M of its AVX2 ones) without its
    call (~26 us with VNNI, ~50 without) or the residual's copy."""
    (qx, x_scale, x_zp, qw_n, ws_n, bias_n, stride, padding, dilation, groups, qother, o_scale, o_zp, out_scale,
     out_zp, post_op, _) = node.args
    x, qw, other = b.value(qx), b.attr(qw_n), b.value(qother)
    if (qw is None or x.dtype != torch.uint8 or x.dim() != 4 or tuple(qw.shape[2:]) != (1, 1) or groups != 1
            or list(stride) != [1, 1] or any(padding) or post_op not in ROW_POST_OPS or not linear_native.sum_available()
            or not x.is_contiguous(memory_format=torch.channels_last)
            or not other.is_contiguous(memory_format=torch.channels_last)):
        return None
    pixels = x.shape[0] * x.shape[2] * x.shape[3]
    engine = _engine(post_op, torch.uint8, pixels, qw.shape[0], qw.shape[1], True)
    if not conv_native.native_engine(engine):
        return None
    row = row_linear(qw.flatten(1).clone(), b.attr(ws_n), b.attr(bias_n), x_scale, x_zp, out_scale, engine, post_op)
    if row is None:  # the native engine's 7-bit grid and a wider weight
        return None
    return b.call(pointwise_rows_sum, qx, b.const(row, "row"), qother, o_scale, o_zp, out_zp,
                  *row_bounds(torch.uint8, out_zp, post_op))


def matmul(b, node):  # lucid_fx.matmul on the CPU -> program_ops.matmul_codes
    qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp = node.args
    dtype = b.value(node).dtype
    if b.kernel("matmul") is not cpu_float.matmul or dtype not in (torch.uint8, torch.int8):
        return None
    low, high = program_ops.code_bounds(dtype, out_zp, "none")
    mult = a_scale * b_scale / out_scale
    plan = matmul_native.matmul_plan(b.value(qa), b.value(qb), a_zp, b_zp) if native.available() else None
    if plan is not None:  # exact int32 sums in one call: attention's q @ k^T and p @ v
        return b.call(matmul_native.matmul_codes, qa, a_zp, qb, b_zp, mult, out_zp, low, high, dtype, b.const(plan, "plan"))
    return b.call(_step("matmul_codes"), qa, a_zp, qb, b_zp, mult, out_zp, low, high, dtype)


def softmax(b, node):  # lucid_fx.softmax on the CPU -> softmax_native.softmax_codes, its table made once
    q, scale, zp, dim, out_scale, out_zp = node.args
    dtype = b.value(node).dtype
    if b.kernel("softmax") is not cpu_float.softmax or dtype not in (torch.uint8, torch.int8):
        return None
    low, high = program_ops.code_bounds(dtype, out_zp, "none")
    table = b.const(program_ops.softmax_table(scale), "exp")
    step = softmax_native.softmax_codes if native.available() else program_ops.softmax_codes
    return b.call(step, q, table, dim, 1.0 / out_scale, out_zp, low, high, dtype)


def masked_softmax(b, node):  # lucid_fx.masked_softmax on the CPU -> the table softmax over what the mask leaves, or float
    q, scale, zp, mask, fill, dim, out_scale, out_zp = node.args
    dtype = b.value(node).dtype
    if (b.kernel("masked_softmax") is not cpu_float.masked_softmax or dtype not in (torch.uint8, torch.int8)
            or (fill is not None and b.value(mask).dtype != torch.bool)):  # the kernel's own error then
        return None
    low, high = program_ops.code_bounds(dtype, out_zp, "none")
    return b.call(softmax_native.masked_softmax_codes, q, scale, zp, mask, fill, dim, 1.0 / out_scale, out_zp, low, high, dtype)


def softmax_matmul(b, node):  # lucid_fx.softmax_matmul on the CPU -> its CPU kernel, the table and the product's plan made once
    q, scale, zp, mask, fill, v, v_scale, v_zp, out_scale, out_zp = node.args
    dtype = b.value(node).dtype
    if (b.kernel("softmax_matmul") is not attention_rows.cpu_softmax_matmul or dtype not in (torch.uint8, torch.int8)
            or (fill is not None and b.value(mask).dtype != torch.bool)):  # the kernel's own error then
        return None
    rows = b.value(q).shape if mask is None else torch.broadcast_shapes(b.value(q).shape, b.value(mask).shape)
    e = torch.empty(rows, dtype=dtype, device="meta")  # e's codes: dense, of the scores' (and mask's) shape
    plan = attention_rows.rows_plan(e, b.value(v), torch.iinfo(dtype).min, v_zp) if native.available() else None
    return b.call(attention_rows.cpu_softmax_matmul, q, scale, zp, mask, fill, v, v_scale, v_zp, out_scale, out_zp,
                  b.const(attention_rows.exp_table(scale), "exp"), None if plan is None else b.const(plan, "rows"))


PROGRAM_RULES_CPU: Dict[str, Callable[..., Optional[fx.Node]]] = {
    **PROGRAM_RULES_CPU_LINEAR,  # lucid_fx.linear -> onednn.qlinear_pointwise (a residual add fused) / linear_row
    "conv2d": conv2d,  # lucid_fx.conv2d -> onednn.qconv2d_pointwise, packed for the input shape
    "conv2d_add": conv2d_add,  # lucid_fx.conv2d_add -> onednn.qconv2d_pointwise.binary("sum")
    "matmul": matmul,  # -> native / program_ops.matmul_codes
    "softmax": softmax,  # -> softmax_native / program_ops.softmax_codes
    "masked_softmax": masked_softmax,  # -> softmax_native.masked_softmax_codes (decided per call by the mask)
    "softmax_matmul": softmax_matmul,  # -> kernels/softmax_matmul.py: e from a table, a multiplier a row
    **PROGRAM_RULES_CPU_ELEMENTWISE,  # the float boundary, tables, add, mul, cat
    **PROGRAM_RULES_CPU_POOL,  # max, average and global average pools of codes
}

#: The program calls planned once, on the program's first call (passes/plan_program_calls.py): a kernel function ->
#: its planner, which takes the same arguments and returns the call's step (scalars bound, shapes fixed) or None.
PROGRAM_PLANS_CPU: Dict[Callable, Callable[..., Optional[Callable]]] = {
    native.quantize_codes: native_elementwise.quantize_step,  # the float boundary,
    native_elementwise.quantize_channels_last: native_elementwise.quantize_channels_last_plan,  # to channels-last,
    matmul_native.matmul_codes: matmul_native.matmul_step,  # attention's q @ k^T,
    attention_rows.cpu_softmax_matmul: attention_rows.softmax_matmul_step,  # softmax(s) @ v
    native.post_op_codes: native.post_op_plan,  # a post-op after a float result (SiLU), its quantize
    conv_native.conv_codes: conv_native.conv_plan,  # lucid_fx's convolutions
    linear_row.linear_row: linear_row.linear_row_plan,  # linears on lucid_fx's GEMM
    pointwise_rows: pointwise_rows_plan,  # 1x1 convolutions on it
    pointwise_rows_sum: pointwise_rows_sum_plan,  # ... with a residual
    native_squeeze_excite.global_avg_pool_codes: native_squeeze_excite.global_avg_pool_plan,  # squeeze-excite's pool,
    cpu_float.lut: cpu_float.lut_plan,  # its gate's table,
    native_squeeze_excite.gate_mul_codes: native_squeeze_excite.gate_mul_plan,  # and its product
}
