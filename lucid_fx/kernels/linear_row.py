"""Small linears (batch 1, or few small rows) off oneDNN, with oneDNN's values bit for bit.

Two engines (``Target.linear_row``): ``"int_mm"`` with VNNI, described below, and without VNNI lucid_fx's own GEMM
(:mod:`lucid_fx.kernels.linear_native`), followed by the float steps of oneDNN's AVX2 kernels, which multiply the two
scales first. Where the native kernels are built with VNNI (``linear_native.full_grid``), the ``"int_mm"`` engine
takes its int32 sums from that same GEMM, exact for every weight, and fuses oneDNN's VNNI float steps in: the values
of the ``torch._int_mm`` route below, in one call instead of three (:data:`VNNI_GEMM_ROWS`).

At one row, ``torch._int_mm`` reads the (K, N) column-major int8 weight as a matrix-vector product, faster than
oneDNN's linear; from two rows up slower (1 thread, AVX512-VNNI EPYC, 1024 x 1024: 40 against 46 us at one row, 119
against 49 at two, 155 against 76 at eight). In a model, where oneDNN's call meets a colder cache, the batch-1 MLP of
``benchmarks/models.py`` ran in 165 us with this route and 233 us without it (same process, same codes). Then come
oneDNN's own float32 steps, one rounding at a time: oneDNN's values bit for bit, whatever the batch around a row.

A 1x1 convolution of a 1x1 image of batch 1 (squeeze-excite's) is such a linear too (MobileNetV3-like: 4.88 against
5.10 ms). Small linears of several rows take it too (:func:`small_gemm`): oneDNN's linear costs 22-24 us a call however
small, this route 10-12 us at 32 x 64 x 64 (the family models of tests/models, hidden size 64).

>>> qw = torch.tensor([[2, -1], [0, 3]], dtype=torch.int8)
>>> row = row_linear(qw, torch.tensor([0.5, 0.25]), None, 1.0, 128, None, rows=1)  # codes - 128 are the values
>>> linear_row(torch.tensor([[130, 126]], dtype=torch.uint8), row, 0, *row_bounds(torch.float32, 0, "none"), torch.float32)
tensor([[ 3.0000, -1.5000]])
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple, Union

import torch

from lucid_fx.kernels import linear_native
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.cpu_features import detected_cpu_features
from lucid_fx.kernels.native_step import native_step, returns_step
from lucid_fx.kernels.int_mm import PREPARED, _gemm_weight, _GemmWeight, _int_mm
from lucid_fx.kernels.onednn_steps import AMX_STEPS, VNNI_STEPS, linear_steps
from lucid_fx.kernels.program_ops import MAGIC, code_bounds, operand
from lucid_fx.kernels.row_sizes import (  # noqa: F401  (read as linear_row.* by tests)
    NATIVE_GEMM_MNK, SMALL_GEMM_MNK, SMALL_GEMM_NK, VNNI_FLOAT_TAIL_ROWS, VNNI_GEMM_ROWS, VNNI_POINTWISE_ROWS,
    VNNI_THREADED_ROWS, amx_gemm, small_gemm)
from lucid_fx.kernels.target import Target
from lucid_fx.kernels.zero_point import _folded_zero_point, _zero_point_exact_on_onednn, signed_zero_point_bias

__all__ = ["ROW_POST_OPS", "ENGINE_POST_OPS", "engine_post_ops", "FLOAT_POST_OPS", "float_post_op",
           "RowLinear", "row_linear", "linear_row", "linear_row_plan", "gemm_plan", "linear_rows", "row_bounds",
           "row_out_scale", "conv_is_row", "row_gemm", "gemm_into", "row_engine", "engine_here", "takes_row", "small_gemm", "SMALL_GEMM_MNK", "SMALL_GEMM_NK",
           "VNNI_GEMM_ROWS", "VNNI_FLOAT_TAIL_ROWS", "VNNI_THREADED_ROWS", "VNNI_POINTWISE_ROWS", "NATIVE_GEMM_MNK"]

ROW_POST_OPS = ("none", "relu")  # the post-ops a one-row linear folds into its clamp bounds
# The post-ops of each engine: lucid_fx's GEMM also computes oneDNN's hardswish (linear_native.hardswish; oneDNN's
# VNNI values on all 530K outputs of six MobileNet-like 1x1 shapes, AVX512-VNNI EPYC) and tanh (tanh_steps, within 4
# ulp; oneDNN's within a code) in its epilogue: the gated MLP (its merged 64 x 1024 -> 2048 tanh linear) 1268 against
# 1387 us with oneDNN's tanh (1 thread, alternating, the same SQNR; with an exp-based tanh, 1151 against 1221).
ENGINE_POST_OPS = {"int_mm": ROW_POST_OPS, "native": (*ROW_POST_OPS, "hardswish", "tanh")}


def engine_post_ops(engine: str) -> Tuple[str, ...]:
    """The post-ops ``engine`` computes here (:data:`ENGINE_POST_OPS`, and hardswish on the VNNI GEMM)."""
    if engine == "int_mm" and linear_native.full_grid():
        return ENGINE_POST_OPS["native"]
    return ENGINE_POST_OPS[engine]

#: Post-ops a linear computes in torch after its float32 result, where no kernel gives oneDNN's values: SiLU (oneDNN's
#: swish approximates exp) on both engines, at any size, so its codes depend neither on the route nor on the batch
#: (oneDNN's swish: 100 us for the Llama-like 32 x 64 x 128 gate, VNNI); sigmoid everywhere (convert gives it as tanh).
FLOAT_POST_OPS = {"native": ("silu",), "int_mm": ("silu",), "every route": ("sigmoid",)}

@dataclass(frozen=True)
class RowLinear:
    """A small linear's constants, decided once, in the form oneDNN's linear receives them: the zero
    point left to it (0 where it went into the bias) comes back as one int32 ``offset`` per output,
    ``(128 - zero point) * row sum`` on ``_int_mm`` (whose codes are shifted into int8), ``-zero point *
    row sum`` on the native engine, whose ``x_scale`` is 1 and ``w_scale`` the two scales' product."""

    weight: Union[_GemmWeight, linear_native.PackedWeight]
    offset: torch.Tensor  # (N,) int32
    x_scale: float
    w_scale: torch.Tensor  # (N,) float32
    bias: Optional[torch.Tensor]  # (N,) float32, or None
    inv_out: Optional[float]  # float32 1 / out_scale; None for a float result
    post: str = "none"  # the post-op the GEMM computes (linear_native.POST; the native GEMM only), relu as bounds


def row_linear(qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor], x_scale: float, x_zp: int,
               out_scale: Optional[float], engine: str = "int_mm", post_op: str = "none",
               rows: Optional[int] = None, steps: Optional[str] = None) -> Optional[RowLinear]:
    """The constants of :func:`linear_row` on ``engine`` for uint8 codes with zero point ``x_zp``
    (``out_scale`` None: a float result; ``post_op`` one of the engine's, relu as the caller's clamp
    bounds), from the same zero-point fold as the oneDNN call of ``lucid_fx.kernels.cpu.linear``; None
    where the native engine does not take ``qw``'s codes. On an AMX CPU, the float steps oneDNN takes for
    ``rows`` rows of it where given (:func:`lucid_fx.kernels.onednn_steps.linear_steps`; None where not known), or
    ``steps`` where the caller asked oneDNN (a convolution's: ``onednn_steps.conv_steps``).
    ``qw`` is a linear's (N, K) weight or a 1x1 convolution's (N, K, 1, 1)."""
    linear = steps is None  # a linear's constants (a convolution's come with its steps: no int8-codes route)
    if steps is None and (engine != "int_mm" or rows is None or few_rows_engine_here() is None):
        steps = VNNI_STEPS  # the engine's own, where no call of ``rows`` rows is to match (tests of its arithmetic)
    elif steps is None:  # an AMX CPU: oneDNN's for the shape
        steps = linear_steps(rows, qw.shape[0], qw[0].numel(), torch.get_num_threads())
        if steps is None:
            return None
    zp_left, bias = _folded_zero_point(qw, w_scale, bias, x_scale, x_zp)
    signed = None if not linear or _zero_point_exact_on_onednn(qw, zp_left) else signed_zero_point_bias(
        qw, w_scale, bias, x_scale, zp_left)
    if signed is not None:  # AMX: oneDNN's call takes int8 codes, their zero point in the bias (cpu.linear): the same sums
        zp_left, bias = 128, signed
    inv_out = None if out_scale is None else ref.f32_reciprocal(out_scale)
    w_scale = w_scale.to(torch.float32)
    if engine == "native":
        weight = PREPARED.get(qw, ("native gemm",), lambda: linear_native.takes_weight(qw)
                              and linear_native.packed_weight(qw.flatten(1)))
        if not weight:
            return None
        scale = torch.tensor(x_scale, dtype=torch.float32) * w_scale  # oneDNN's AVX2 kernels: one product first
        return RowLinear(weight, -zp_left * weight.row_sums, 1.0, scale, bias, inv_out, linear_native.kernel_post(post_op))
    assert post_op in engine_post_ops("int_mm"), post_op
    if linear_native.full_grid():  # the same sums from the native VNNI GEMM, and oneDNN's VNNI float steps
        weight = PREPARED.get(qw, ("vnni gemm",), lambda: linear_native.packed_weight(qw.flatten(1)))
        if steps == AMX_STEPS:  # the scales' product first, as the native engine's x_scale 1 gives it
            scale = torch.tensor(x_scale, dtype=torch.float32) * w_scale
            return RowLinear(weight, -zp_left * weight.row_sums, 1.0, scale, bias, inv_out, linear_native.kernel_post(post_op))
        return RowLinear(weight, -zp_left * weight.row_sums, x_scale, w_scale, bias, inv_out, linear_native.kernel_post(post_op))
    if steps != VNNI_STEPS:
        return None  # _int_mm's torch steps are VNNI's
    weight = PREPARED.get(qw, ("linear", False), lambda: _gemm_weight(qw.flatten(1), False))
    return RowLinear(weight, (128 - zp_left) * weight.row_sums, x_scale, w_scale, bias, inv_out)


@returns_step("q")
def linear_row(q: torch.Tensor, row: RowLinear, zp: int, low: float, high: float, dtype: torch.dtype,
               plan: Optional[Callable] = None) -> torch.Tensor:
    """The linear of uint8 codes ``q`` (rows, K), as oneDNN's linear computes it: the int32 sums, then
    ``acc * x_scale * w_scale + bias`` in float32 one rounding at a time, then ``round(y / out_scale +
    zp)`` clamped to ``[low, high]`` (relu is the lower bound). tests/kernels/test_linear_row.py
    compares it with oneDNN on 2048 rows per case. ``plan``: :func:`linear_row_plan`'s."""
    out = None if plan is None else plan(q)
    if out is not None:
        return out
    if isinstance(row.weight, linear_native.PackedWeight):
        return linear_native.gemm_rows(q, row.weight, row.offset, row.x_scale, row.w_scale, row.bias,
                                       0.0 if row.inv_out is None else row.inv_out, zp, low, high, dtype, row.post)
    # Numbers go in as 0-dim tensors (program_ops.operand): a Python number costs a cast copy per call.
    acc = _int_mm(torch.bitwise_xor(q, operand(128, torch.uint8)).view(torch.int8), row.weight.b, row.weight.halves)
    out = linear_native.row_epilogue(acc, row.offset, row.x_scale, row.w_scale, row.bias, row.inv_out, zp, low, high, dtype)
    if out is not None:  # the steps below in one pass
        return out
    y = acc.add_(row.offset).mul(operand(row.x_scale)).mul_(row.w_scale)
    if row.bias is not None:
        y = y.add_(row.bias)
    if dtype == torch.float32:
        return y.clamp_(low, high) if low > -math.inf else y
    y = y.mul_(operand(row.inv_out)).add_(operand(zp)).clamp_(low, high)  # integer bounds: clamping first is the same
    return y.add_(operand(MAGIC)).view(torch.int32).to(dtype)  # the round: program_ops.MAGIC


def row_gemm(row: RowLinear, codes: int, zp: int, low: float, high: float, dtype: torch.dtype,
             residual: Optional[linear_native.Residual] = None) -> Optional[Callable]:
    """lucid_fx's GEMM of ``row`` on ``codes`` codes (``codes / K`` rows) with every argument but the storage bound
    (:func:`lucid_fx.kernels.linear_native.gemm_call`: ``gemm(q_ptr, out_ptr[, accum_ptr])``); None where ``row``
    has no native weight or the native kernels are not loaded."""
    if not isinstance(row.weight, linear_native.PackedWeight):
        return None
    return linear_native.gemm_call(codes // row.weight.k, row.weight, row.offset, row.x_scale, row.w_scale, row.bias,
                                   0.0 if row.inv_out is None else row.inv_out, zp, low, high, dtype, row.post, residual)


def gemm_into(q: torch.Tensor, out: torch.Tensor, row: RowLinear, zp: int, low: float, high: float,
              dtype: torch.dtype) -> bool:
    """lucid_fx's GEMM of ``row`` on the rows ``q``'s storage holds, into ``out``'s (:func:`row_gemm`); False
    (nothing written) where ``row`` has no native weight or the native kernels are not loaded."""
    gemm = row_gemm(row, q.numel(), zp, low, high, dtype)
    if gemm is not None:
        gemm(q.data_ptr(), out.data_ptr())
    return gemm is not None


def linear_rows(q: torch.Tensor, row: RowLinear, zp: int, low: float, high: float, dtype: torch.dtype) -> torch.Tensor:
    """:func:`linear_row` along the last dim of codes ``q`` of any rank (a transformer's (batch, seq,
    K)), the result (..., N) contiguous: on lucid_fx's GEMM a dense ``q``'s storage is its rows in
    place and the result is written directly, where a reshape to rows and a view back took two torch
    calls a linear."""
    step = gemm_plan(q, row, zp, low, high, dtype, (*q.shape[:-1], getattr(row.weight, "n", 0)),
                     torch.contiguous_format) if q.is_contiguous() else None
    out = None if step is None else step(q)
    if out is not None:
        return out
    return linear_row(q.reshape(-1, q.shape[-1]), row, zp, low, high, dtype).view(*q.shape[:-1], -1)


def linear_row_plan(q: torch.Tensor, row: RowLinear, zp: int, low: float, high: float,
                    dtype: torch.dtype) -> Optional[Callable]:
    """:func:`linear_row`'s GEMM call for contiguous rows laid out as ``q``, checked once: ``step(q)``, or None
    for rows of other strides. None where lucid_fx's GEMM does not take them."""
    if q.dim() != 2 or not q.is_contiguous():
        return None
    return gemm_plan(q, row, zp, low, high, dtype, (q.shape[0], row.weight.n), torch.contiguous_format)


def gemm_plan(q: torch.Tensor, row: RowLinear, zp: int, low: float, high: float, dtype: torch.dtype, shape: tuple,
               layout: torch.memory_format, residual: Optional[linear_native.Residual] = None) -> Optional[Callable]:
    """The GEMM of ``row`` on the rows dense uint8 ``q``'s storage holds into a new tensor of ``shape`` in
    ``layout`` (plus a residual laid out as it: ``step(q, other)``; uint8 codes, or float32 for ADDEND), for codes of
    ``q``'s strides: ``step(q)``. ``q`` may be a meta tensor (a program planned before it runs: row_plan.py)."""
    k = q.shape[1 if q.dim() == 4 else -1]  # (N, K, H, W) channels-last, or (..., K)
    gemm = row_gemm(row, q.numel(), zp, low, high, dtype, residual) if q.dtype == torch.uint8 and (q.is_cpu or q.is_meta) else None
    if gemm is None or k != row.weight.k:
        return None
    strides = torch.empty(shape, memory_format=layout, device="meta").stride()
    inputs = [(q.shape, q.stride(), torch.uint8)]
    if residual is not None:  # laid out as the result (other strides of it take the checked path)
        inputs.append((shape, strides, torch.float32 if residual == linear_native.ADDEND else torch.uint8))
    # the call as data: C++ does the checks, the allocation and the call (native_step.py)
    return native_step(gemm.call, inputs, [(shape, strides, dtype)], gemm.pointers, keep=gemm)


def row_bounds(dtype: torch.dtype, zp: int, post_op: str) -> Tuple[float, float]:
    """The clamp bounds of :func:`linear_row`: codes of ``dtype`` (relu: from the zero point up), or
    real numbers for float32 (relu: from 0)."""
    if dtype == torch.float32:
        return (0.0 if post_op == "relu" else -math.inf), math.inf
    return code_bounds(dtype, zp, post_op)


def row_out_scale(out_scale: float, dtype: torch.dtype) -> Optional[float]:
    """The output scale :func:`row_linear` takes: None for a float result."""
    return None if dtype == torch.float32 else out_scale


def conv_is_row(x_shape: Sequence[int], w_shape: Sequence[int], padding: Sequence[int], groups: int) -> bool:
    """Whether a convolution is a linear of one row: an unpadded, ungrouped 1x1 kernel on a 1x1 image of batch 1."""
    return (len(x_shape) == 4 and x_shape[0] == 1 and tuple(x_shape[2:]) == (1, 1) and tuple(w_shape[2:]) == (1, 1)
            and groups == 1 and not any(padding))


def row_engine(target: Target, rows: Optional[int] = None) -> Optional[str]:
    """``target.linear_row`` where its float steps are this machine's oneDNN's, bit for bit, else None:
    ``"int_mm"`` where oneDNN runs its AVX512-VNNI kernels, ``"native"`` its AVX2 ones (with the vectorized
    GEMM), and on an AMX CPU ``"int_mm"`` for up to ``target.row_limit`` ``rows`` (any number where
    lucid_fx's AMX GEMM is on), with the steps its oneDNN takes for the shape (:func:`row_linear`). Verified on real CPUs of each kind; a forced kind (or a lower
    ``ONEDNN_MAX_CPU_ISA``) on other hardware keeps oneDNN, whose kernels there round otherwise."""
    if target.linear_row is not None and target.linear_row == engine_here():
        return target.linear_row
    tiles = target.row_limit is not None and linear_native.amx()  # any rows: takes_row says which (amx_gemm)
    few = rows is not None and target.row_limit is not None and (tiles or rows <= target.row_limit)
    return target.linear_row if few and target.linear_row == few_rows_engine_here() else None


@functools.lru_cache(maxsize=None)
def few_rows_engine_here() -> Optional[str]:
    """The engine that takes a few rows (``Target.row_limit``) with the float steps this machine's oneDNN takes for
    their shape (:mod:`lucid_fx.kernels.onednn_steps`): ``"int_mm"`` on an AMX CPU, else None."""
    return "int_mm" if detected_cpu_features().amx and not os.environ.get("ONEDNN_MAX_CPU_ISA", "") else None


@functools.lru_cache(maxsize=None)
def engine_here() -> Optional[str]:
    """The engine whose float steps are those of the oneDNN kernels this machine runs, or None."""
    kind, isa = detected_cpu_features().name, os.environ.get("ONEDNN_MAX_CPU_ISA", "")
    if kind == "avx512_vnni" and not isa:
        return "int_mm"
    # an AVX2 CPU capped at AVX2 (tests force every kind so) runs the same oneDNN kernels
    return "native" if kind == "avx2" and isa.upper() in ("", "AVX2") and linear_native.available() else None


def float_post_op(target: Target, onednn_on: bool, post_op: str, dtype: torch.dtype, mnk: Optional[tuple] = None) -> bool:
    """Whether a linear with ``post_op`` and uint8 codes (any result, for sigmoid) out computes the post-op after its
    float32 result (:data:`FLOAT_POST_OPS`, then :func:`lucid_fx.kernels.native.post_op_codes`); gelu and tanh (where the GEMM has none) too
    where the row engine takes the (m, n, k) linear ``mnk``: oneDNN's call costs more there (its gelu is torch's)."""
    engine = row_engine(target)
    in_gemm = engine is not None and post_op in engine_post_ops(engine)
    everywhere = post_op in FLOAT_POST_OPS["every route"] or (post_op in ("gelu", "gelu_tanh", "tanh") and not in_gemm
        and mnk is not None and takes_row(target, onednn_on, "none", torch.float32, *mnk, rows=VNNI_FLOAT_TAIL_ROWS))
    return bool(onednn_on and (everywhere or dtype == torch.uint8 and post_op in FLOAT_POST_OPS.get(engine or "", ())))


def takes_row(target: Target, onednn_on: bool, post_op: str, dtype: torch.dtype, m: int, n: int,
              k: int, pointwise: bool = False, rows: Optional[int] = None) -> Optional[str]:
    """The engine an (m, k) by (k, n) linear (a 1x1 convolution's: ``pointwise``) with this post-op and
    result runs on (:func:`row_engine`, where :func:`small_gemm` says it is faster there), while
    oneDNN serves the others (``onednn_on``); None for oneDNN."""
    engine = row_engine(target, m) if onednn_on and dtype in (torch.uint8, torch.float32) else None
    amx = target.row_limit is not None
    if amx and (m > target.row_limit and not amx_gemm(m, n, k) or pointwise or post_op not in ROW_POST_OPS):
        return None  # AMX: linears of a few rows, or lucid_fx's AMX GEMM's, whose steps oneDNN's own call says (onednn_steps.py)
    fits = m <= (rows or m) if amx else small_gemm(m, n, k, engine, pointwise, rows)
    takes = engine is not None and post_op in engine_post_ops(engine) and fits
    return engine if takes else None
