"""Which float32 steps oneDNN's int8 linear takes after its int32 sums on an AMX CPU, for a shape: asked of oneDNN
itself, once per shape.

On AVX512-VNNI CPUs its kernels take ``(acc * x_scale) * w_scale + bias``, and without VNNI ``acc * (x_scale *
w_scale) + bias``, whatever the shape (lucid_fx's row engines copy each: :mod:`lucid_fx.kernels.linear_row`). An
AMX CPU runs both, by its own choice of kernel for the shape (measured, torch 2.13, Xeon with AMX, 2 threads): one
row of 1024 inputs takes the first with 256 outputs and the second with 1024; 64 outputs take the first up to 4
rows; 13 inputs take the first at every size. So where the row engine takes a few rows there
(``Target.row_limit``), :func:`linear_steps` runs oneDNN's linear on probe codes of that shape and says which of
the two it matched, in float32 and in uint8 codes, or None (the engine then leaves that linear to oneDNN).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import torch
import torch.nn.functional as F

from lucid_fx.kernels.codes import f32_reciprocal, onednn_post_op
from lucid_fx.kernels.linear_native import hardswish

__all__ = ["linear_steps", "conv_steps", "VNNI_STEPS", "AMX_STEPS", "PROBES"]

VNNI_STEPS = "vnni"  # (acc * x_scale) * w_scale + bias: one scale at a time
AMX_STEPS = "amx"  # acc * (x_scale * w_scale) + bias: the two scales' product first
OUT_SCALE = 0.0371  # the probe's uint8 result: a scale whose float32 reciprocal is inexact
#: The post-ops :func:`conv_steps` checks, as lucid_fx's kernels compute them after the float32 result.
CONV_POST_OPS = {"none": lambda y: y, "relu": lambda y: y.clamp_min(0.0), "hardswish": hardswish}
#: Probe calls at most: the first tells the two apart where it has a few dozen outputs (they differ on a quarter to a
#: third of them); a linear of a handful of outputs takes more.
PROBES = 64
#: Rows checked at each end of a probe of many rows (:func:`_checked_rows`): a tail of rows oneDNN ran on another
#: kernel would be among the last.
CHECKED_ROWS = 16


@functools.lru_cache(maxsize=None)
def linear_steps(m: int, n: int, k: int, threads: int) -> Optional[str]:
    """:data:`VNNI_STEPS` or :data:`AMX_STEPS`: the float steps oneDNN's int8 linear of ``m`` rows by an (n, k) weight
    takes here at ``threads`` threads (its choice of kernel may follow them), or None where probes matched neither or
    could not tell them apart."""
    g = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    qw = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    packed = _onednn_pack(qw)
    zeros = torch.zeros(n, dtype=torch.int64)
    left = {VNNI_STEPS, AMX_STEPS}
    x_scale = torch.tensor(0.0213, dtype=torch.float32)
    for _ in range(PROBES):
        qx = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
        ws = torch.rand(n, generator=g) * 1e-3 + 2e-4
        bias = torch.randn(n, generator=g)
        y = _onednn_linear(qx, float(x_scale), packed, ws, zeros, bias, 1.0, 0, torch.float32)
        codes = _onednn_linear(qx, float(x_scale), packed, ws, zeros, bias, OUT_SCALE, 100, torch.uint8)
        rows = _checked_rows(m)  # oneDNN ran the whole shape (its kernel follows it); its first and last rows checked
        acc = (qx[rows].to(torch.float64) @ qw.to(torch.float64).t()).to(torch.float32)  # exact, rounded as oneDNN's
        left &= _matching({VNNI_STEPS: acc * x_scale * ws + bias, AMX_STEPS: acc * (x_scale * ws) + bias}, y[rows],
                          codes[rows])
        if len(left) < 2:
            break
    return left.pop() if len(left) == 1 else None


@functools.lru_cache(maxsize=None)
def conv_steps(x_shape: Tuple[int, ...], w_shape: Tuple[int, ...], stride: Tuple[int, ...], padding: Tuple[int, ...],
               dilation: Tuple[int, ...], groups: int, post_op: str, threads: int) -> Optional[str]:
    """:func:`linear_steps` for oneDNN's int8 2-d convolution of channels-last uint8 codes of ``x_shape`` by a weight of
    ``w_shape`` (packed for that input shape, as lucid_fx packs it) with ``post_op`` (none, relu or hardswish: its
    values as lucid_fx's kernels compute them, :func:`lucid_fx.kernels.linear_native.hardswish`), at ``threads``
    threads."""
    post = CONV_POST_OPS.get(post_op)
    if post is None:
        return None
    g = torch.Generator().manual_seed(sum(x_shape) * 7919 + sum(w_shape) * 31 + groups)
    qw = torch.randint(-128, 128, w_shape, dtype=torch.int8, generator=g)
    n = w_shape[0]
    left = {VNNI_STEPS, AMX_STEPS}
    x_scale = torch.tensor(0.0213, dtype=torch.float32)
    ws = torch.rand(n, generator=g) * 1e-3 + 2e-4
    packed = torch.ops.onednn.qconv_prepack(qw, ws, 1.0, 0, list(stride), list(padding), list(dilation), groups,
                                            list(x_shape))
    zeros = torch.zeros(n, dtype=torch.int64)
    for _ in range(PROBES):
        qx = torch.randint(0, 256, x_shape, dtype=torch.uint8, generator=g).contiguous(memory_format=torch.channels_last)
        bias = torch.randn(n, generator=g)
        args = (list(stride), list(padding), list(dilation), groups)
        y = torch.ops.onednn.qconv2d_pointwise.default(qx, float(x_scale), 0, packed, ws, zeros, bias, *args, 1.0, 0,
                                                      torch.float32, *onednn_post_op(post_op))
        codes = torch.ops.onednn.qconv2d_pointwise.default(qx, float(x_scale), 0, packed, ws, zeros, bias, *args,
                                                          OUT_SCALE, 100, torch.uint8, *onednn_post_op(post_op))
        acc = F.conv2d(qx.to(torch.float64), qw.to(torch.float64), None, *args).to(torch.float32)
        ws4, bias4 = ws.view(1, -1, 1, 1), bias.view(1, -1, 1, 1)
        candidates = {VNNI_STEPS: post(acc * x_scale * ws4 + bias4), AMX_STEPS: post(acc * (x_scale * ws4) + bias4)}
        left &= _matching(candidates, y, codes)
        if len(left) < 2:
            break
    return left.pop() if len(left) == 1 else None


def _checked_rows(m: int) -> torch.Tensor:
    """The rows of an m-row probe whose float steps are checked: all of a few, else the first and last CHECKED_ROWS (the
    exact float64 product of all of them took most of a probe's time at many rows: 132 ms at 4096 x 1024 x 1024)."""
    if m <= 2 * CHECKED_ROWS:
        return torch.arange(m)
    return torch.cat([torch.arange(CHECKED_ROWS), torch.arange(m - CHECKED_ROWS, m)])


def _matching(candidates: dict, y: torch.Tensor, codes: torch.Tensor) -> set:
    """The names of the float32 ``candidates`` that are oneDNN's float result ``y`` and, quantized as lucid_fx's kernels
    quantize (``linear_native.finish``: times the scale's float32 reciprocal, plus 100, clamped, rounded), its uint8
    result ``codes`` (scale OUT_SCALE, zero point 100)."""
    inv_out = torch.tensor(f32_reciprocal(OUT_SCALE), dtype=torch.float32)
    return {name for name, want in candidates.items() if torch.equal(want, y)
            and torch.equal(want.mul(inv_out).add_(100).clamp_(0, 255).round_().to(torch.uint8), codes)}


def _onednn_pack(qw: torch.Tensor) -> torch.Tensor:
    return torch.ops.onednn.qlinear_prepack(qw, None)


def _onednn_linear(qx, x_scale: float, packed, w_scale, zeros, bias, out_scale: float, out_zp: int, dtype):
    """oneDNN's int8 linear of uint8 codes (zero point 0) into ``dtype``, no post-op."""
    return torch.ops.onednn.qlinear_pointwise.default(qx, x_scale, 0, packed, w_scale, zeros, bias, out_scale, out_zp,
                                                      dtype, "none", [], "")
