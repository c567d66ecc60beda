"""Attention's ``softmax(s) @ v`` with each row's probabilities on a grid of their own: ``lucid_fx::softmax_matmul``.

A softmax's fixed grid, ``[0, 1]`` in steps of 1/256, suits a row whose mass sits on a few keys. A
row spread over 128 keys has probabilities near 1/128, two codes each: the encoder block's softmax
measured 17 dB SQNR against its float value, and ``p @ v`` 19 dB. Here the probabilities stay
unnormalised until the product has summed them: ``e = exp(s - max(s))`` on the grid 1/255 of
``[0, 1]`` (the row's largest is code 255), and the division by the row's ``sum(e)`` is the
product's requantization, one multiplier per row::

    out = requantize((e @ (v - v_zp)) * v_scale / (sum(e) * out_scale))

A row's probabilities ``e / sum(e)`` thus have the step ``1 / (255 * sum(e))``: never coarser than
the fixed grid's (``sum(e) >= 1``, the largest being 1), ``sum(e)`` times finer where the mass is
spread. Both ranges are still proven, not measured: ``e`` lies in ``[0, 1]`` whatever the data.
Convert fuses a softmax along the last dim whose only consumer is a matmul's left operand
(rules/lowering_attention.py); reference mode puts :func:`probabilities_qdq`, this rounding of the
probabilities in float, where the softmax's grid would be (passes/insert_qdq.py).

The reference kernel computes in float (``exp`` of the dequantized, masked scores; the product in
float64, exact). The CPU kernel reads ``e``'s codes from a table of 256 (:func:`exp_table`, no
``exp`` at run time), sums them exactly and multiplies in int32 (native_softmax.c's ``softmax_exp``
and native_matmul.c with a multiplier a row, or the same steps in torch, bit for bit): codes can
differ from the reference's by a step where the table's rounding moves an ``e`` by one.

>>> s = torch.tensor([[[0, 10, 20]]], dtype=torch.uint8)  # scores 0, 1, 2 at scale 0.1
>>> v = torch.tensor([[[0], [100], [200]]], dtype=torch.uint8)  # values 0, 1, 2 at scale 0.01
>>> exp_table(0.1)[[20, 10, 0]]  # e's codes for the three scores: 255 * exp(-2), 255 * exp(-1), 255
tensor([ 35,  94, 255], dtype=torch.uint8)
>>> softmax_matmul(s, 0.1, 0, None, None, v, 0.01, 0, 0.01, 0)  # (35 * 0 + 94 * 1 + 255 * 2) / 384 / 0.01
tensor([[[157]]], dtype=torch.uint8)
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional, Tuple

import torch

from lucid_fx.kernels.attention import apply_mask, as_bias, check_mask
from lucid_fx.kernels.codes import finish
from lucid_fx.kernels.matmul_native import matmul_plan
from lucid_fx.kernels import native
from lucid_fx.kernels.native import _function
from lucid_fx.kernels.native_step import BUFFER, IN, native_chain, returns_step
from lucid_fx.kernels.program_ops import centered, code_bounds, requantize_codes
from lucid_fx.kernels.reference import dequant
from lucid_fx.kernels.softmax_native import table_keep

__all__ = ["softmax_matmul", "fake_softmax_matmul", "probabilities_qdq", "fake_probabilities_qdq", "EXP_LEVELS",
           "exp_table", "exp_codes", "torch_exp_codes", "exp_codes_float", "exp_codes_bias", "torch_exp_codes_float", "matmul_rows", "torch_matmul_rows", "rows_plan", "cpu_softmax_matmul", "softmax_matmul_step",
           "INT32_SUM", "TABLE_MIN", "BIAS_TABLE_MIN"]

#: The largest sum the native product's int32 holds.
INT32_SUM = 2 ** 31 - 1
#: The exponentials' codes: ``round(EXP_LEVELS * e)``, a row's largest ``e`` (1) at the top code.
EXP_LEVELS = 255


def _exp_float(y: torch.Tensor) -> torch.Tensor:
    """``round(EXP_LEVELS * exp(y - max(y)))`` along the last dim, in float32 (``y`` a temporary); a
    row that is -inf everywhere (masked) is all 0."""
    e = torch.exp(y.sub_(y.amax(-1, keepdim=True))).nan_to_num_(nan=0.0)
    return e.mul_(EXP_LEVELS).round_()


def softmax_matmul(
    q: torch.Tensor, scale: float, zp: int, mask: Optional[torch.Tensor], fill: Optional[float],
    v: torch.Tensor, v_scale: float, v_zp: int, out_scale: float, out_zp: int,
) -> torch.Tensor:
    """``softmax(s) @ v`` along ``s``'s last dim, ``s`` the dequantized scores masked as
    ``lucid_fx::masked_softmax`` masks them (``mask`` None: not masked), with the probabilities on
    each row's grid (see the module); codes of ``v``'s dtype, contiguous."""
    y = dequant(q, scale, zp)
    if mask is not None:
        check_mask(mask, fill)
        y = apply_mask(y, mask, fill)
    e = _exp_float(y).to(torch.float64)
    total = e.sum(-1, keepdim=True)
    out = torch.matmul(e, dequant(v, 1.0, v_zp).to(torch.float64))  # exact: integers below 2^53
    out = out.mul_(v_scale).div_(total).nan_to_num_(nan=0.0)  # a row with nothing left: 0
    return finish(out.to(torch.float32), "none", out_scale, out_zp, v.dtype).contiguous()


def fake_softmax_matmul(q, scale, zp, mask, fill, v, v_scale, v_zp, out_scale, out_zp):
    rows = q.shape if mask is None else torch.broadcast_shapes(q.shape, mask.shape)
    shape = torch.matmul(torch.empty(rows, device="meta"), torch.empty(v.shape, device="meta")).shape
    return torch.empty(shape, dtype=v.dtype, device=v.device)


def probabilities_qdq(p: torch.Tensor) -> torch.Tensor:
    """Probabilities ``p`` (a softmax along the last dim) as :func:`softmax_matmul` rounds them, in
    float: ``e = round(EXP_LEVELS * p / max(p))``, then ``e / sum(e)``. Reference mode's stand-in
    for the quantize -> dequantize of a softmax that convert fuses into its matmul."""
    e = p.to(torch.float32).div(p.amax(-1, keepdim=True)).nan_to_num_(nan=0.0).mul_(EXP_LEVELS).round_()
    return e.div_(e.sum(-1, keepdim=True)).nan_to_num_(nan=0.0).to(p.dtype)


def fake_probabilities_qdq(p):
    return torch.empty_like(p)


# ---- CPU: a table of e's codes, exact sums, one multiplier a row ----

@functools.lru_cache(maxsize=1024)
def exp_table(scale: float) -> torch.Tensor:
    """``round(EXP_LEVELS * exp(-d * scale))`` for ``d = 0..255`` (uint8, read only): the code of ``e``
    for a score ``d`` steps below its row's largest."""
    d = torch.arange(256, dtype=torch.float64)
    return torch.round(torch.exp(d * -scale) * EXP_LEVELS).to(torch.uint8)


def exp_codes(q: torch.Tensor, table: torch.Tensor, keep: Optional[torch.Tensor], mult: float, e_zp: int,
              dtype: torch.dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``e``'s codes (``dtype``, zero point ``e_zp``, ``q``'s shape, contiguous) for scores ``q`` along
    the last dim, and each row's multiplier ``float32(mult / sum(e))`` (0 for a row ``keep``, bool in
    ``q``'s shape, leaves empty): in one native pass where it is loaded and ``q`` is dense."""
    rows, n = q.shape[:-1].numel(), q.shape[-1]
    fn = _function("softmax_exp", dtype)
    if fn is not None and q.dtype == dtype and q.is_cpu and q.is_contiguous() and q.numel():
        out, rmult = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32)
        kept = None if keep is None else keep.contiguous().view(torch.uint8)
        fn(q.data_ptr(), None if kept is None else kept.data_ptr(), table.data_ptr(), out.data_ptr(),
           rmult.data_ptr(), rows, n, mult, e_zp)
        return out, rmult
    return torch_exp_codes(q, table, keep, mult, e_zp, dtype)


def torch_exp_codes(q, table, keep, mult: float, e_zp: int, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`exp_codes` in torch ops: native_softmax.c's ``softmax_exp`` steps, its results bit for bit."""
    wide = q.to(torch.int32)
    top = (wide if keep is None else wide.masked_fill(~keep, -256)).amax(-1, keepdim=True)
    e = table[(top - wide).bitwise_and_(255).to(torch.int64)].to(torch.int32)
    if keep is not None:
        e = e.masked_fill_(~keep, 0)
    return _codes_and_multipliers(e, mult, e_zp, dtype)


def exp_codes_float(y: torch.Tensor, mult: float, e_zp: int, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`exp_codes` from float32 scores ``y`` (a temporary, masked): native_softmax.c's
    ``softmax_exp_float`` in one pass where it is loaded, else :func:`torch_exp_codes_float`; within a
    code of each other (native_softmax.c's exponential and torch's ``exp`` may differ in the last bits)."""
    fn = _function("softmax_exp_float", dtype)
    if fn is None or y.dtype != torch.float32 or not y.is_cpu or not y.is_contiguous() or not y.numel():
        return torch_exp_codes_float(y, mult, e_zp, dtype)
    out, rmult = torch.empty(y.shape, dtype=dtype), torch.empty(y.shape[:-1], dtype=torch.float32)
    fn(y.data_ptr(), out.data_ptr(), rmult.data_ptr(), y.shape[:-1].numel(), y.shape[-1], mult, e_zp)
    return out, rmult


def exp_codes_bias(q: torch.Tensor, zp: int, scale: float, bias: torch.Tensor, mult: float, e_zp: int,
                   dtype) -> Optional[Tuple[torch.Tensor, torch.Tensor]]:
    """:func:`exp_codes_float` of the scores ``(q - zp) * scale + bias`` (codes ``q`` of ``dtype``, a float32
    ``bias`` that broadcasts to them: BERT's additive padding mask), their floats made in the same native
    pass as torch makes them, so the same codes; None where the native kernels do not take the operands."""
    fn = _function("softmax_exp_bias", dtype)
    if (fn is None or q.dtype != dtype or bias.dtype != torch.float32 or not q.is_cpu or not bias.is_cpu
            or not q.is_contiguous()):
        return None
    geometry = _bias_geometry(q.shape, bias.shape, bias.stride())
    if geometry is None:
        return None
    out, rmult = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32)
    if fn(q.data_ptr(), bias.data_ptr(), out.data_ptr(), rmult.data_ptr(), geometry, scale, zp, mult, e_zp):
        raise MemoryError("lucid_fx: the native softmax could not allocate a row's scores")
    return out, rmult


@functools.lru_cache(maxsize=1024)
def _bias_geometry(shape: torch.Size, bias_shape: torch.Size, bias_stride: Tuple[int, ...]):
    """native_softmax.c's geometry for scores of ``shape`` and a bias of this shape and strides (its checks
    and this list cost some 6 us a call, the kernel 7 at BERT's 2x4x16x16), or None where it does not apply."""
    if (not 1 <= len(shape) <= 4 or len(bias_shape) > len(shape) or not shape.numel()
            or any(b not in (1, n) for b, n in zip(reversed(bias_shape), reversed(shape)))):
        return None
    strides = [0] * (4 - len(bias_shape)) + [0 if b == 1 else s for b, s in zip(bias_shape, bias_stride)]  # 0: broadcast
    rows = [1] * (4 - len(shape)) + list(shape[:-1])
    return (ctypes.c_int64 * 8)(*rows[-3:], shape[-1], *strides[-4:]) if strides[-1] in (0, 1) else None


def torch_exp_codes_float(y: torch.Tensor, mult: float, e_zp: int, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """:func:`exp_codes_float` in torch ops."""
    return _codes_and_multipliers(_exp_float(y).to(torch.int32), mult, e_zp, dtype)


def _codes_and_multipliers(e: torch.Tensor, mult: float, e_zp: int, dtype) -> Tuple[torch.Tensor, torch.Tensor]:
    """``e`` (integers 0..EXP_LEVELS) as codes, and ``float32(mult / sum(e))`` a row (0 where the sum is)."""
    total = e.sum(-1, dtype=torch.int64).to(torch.float64)
    rmult = torch.where(total > 0, mult / total, 0.0).to(torch.float32)
    return e.add_(e_zp).to(dtype).contiguous(), rmult


def rows_plan(rows_like: torch.Tensor, v: torch.Tensor, e_zp: int, v_zp: int):
    """native_matmul.c's plan for ``e @ v`` (``rows_like``: ``e``, fake or real, contiguous) where its
    multiplier a row applies: ``e``'s batch dims not broadcast to the product's. None otherwise."""
    plan = matmul_plan(rows_like, v, e_zp, v_zp, limit=INT32_SUM)  # the torch route sums in float64
    return plan if plan is not None and tuple(plan.out_shape[:-1]) == tuple(rows_like.shape[:-1]) else None


def matmul_rows(e, e_zp: int, v, v_zp: int, rmult: torch.Tensor, zp: int, low: int, high: int, dtype, plan=None):
    """Codes of ``(e - e_zp) @ (v - v_zp)``, each row times its ``rmult``: native_matmul.c where ``plan``
    (:func:`rows_plan`) matches the operands, else torch: the same int32 sums (exact in float64), the
    same float32 multiply, bit for bit."""
    fn = _function("matmul", dtype)
    if (plan is not None and fn is not None and e.dtype == dtype and v.dtype == dtype and e.stride() == plan.a_stride
            and v.stride() == plan.b_stride and e.is_cpu and v.is_cpu):
        out = torch.empty(plan.out_shape, dtype=dtype)
        if fn(e.data_ptr(), v.data_ptr(), out.data_ptr(), plan.geometry.data_ptr(), e_zp, v_zp, 0.0,
              rmult.data_ptr(), zp, low, high):
            raise MemoryError("lucid_fx: the native matmul could not allocate its packed operands")
        return out
    return torch_matmul_rows(e, e_zp, v, v_zp, rmult, zp, low, high, dtype)


def torch_matmul_rows(e, e_zp: int, v, v_zp: int, rmult: torch.Tensor, zp: int, low: int, high: int, dtype):
    """:func:`matmul_rows` in torch ops: the sums in float64 (exact), then native_matmul.c's float32 steps."""
    sums = torch.matmul(centered(e, e_zp).to(torch.float64), centered(v, v_zp).to(torch.float64))
    y = sums.to(torch.float32).mul_(rmult.unsqueeze(-1))
    return requantize_codes(y, zp, low, high, dtype).contiguous()


#: Scores from which a softmax_matmul masked by a bool mask and a finite fill takes the table route
#: (softmax_native.table_keep). Its float route is one native pass but still a float32 copy of the scores,
#: and the table's exponentials feed the product directly. Measured on the AVX512-VNNI EPYC (one thread,
#: the routes taking turns, a padding mask over half the keys, 64-wide values), table / float time: 1.07-1.10
#: at 2048 scores (2x4x16x16), 0.91-0.97 at 4096, 0.74-0.85 at 8192, 0.44-0.65 from 16K to 64K; with the
#: vectorized exponentials (2026-12-03) 0.84-1.01 at 2048, 0.75-1.03 at 4096, 0.88-0.95 from 8K to 64K,
#: 0.76-1.13 from 128K to 1M; the same codes.
TABLE_MIN = 2 ** 12
#: Scores from which a mask that is a bias (BERT's ``(1 - mask) * finfo.min``), or a bool mask filling -inf
#: (a bias of 0 and -inf, :func:`~lucid_fx.kernels.attention.as_bias`: transformers' BERT), takes the table
#: route where the mask allows it; below it, and where it does not (ALiBi), :func:`exp_codes_bias`. Measured
#: as above, table / bias time, two runs each: a bias 1.52-1.62 at 2048-4096 scores, 1.25-1.43 at 8K-16K,
#: 0.97-1.18 at 32K-64K, 0.74-1.45 at 128K, 0.63-1.16 from 512K to 1M; a bool mask filling -inf 0.85-2.0
#: at 2048, 0.94-1.33 from 4096 to 128K, 0.52-0.99 at 1M.
BIAS_TABLE_MIN = 2 ** 17


@returns_step("q", "v")
def cpu_softmax_matmul(q, scale, zp, mask, fill, v, v_scale, v_zp, out_scale, out_zp, table=None, rows=None, plan=None):
    """The CPU kernel (and the program's call, with ``table`` and ``rows`` (:func:`rows_plan`) made once): ``e``
    from the table, over what a padding or causal mask leaves (``softmax_native.table_keep``, as
    ``masked_softmax``), from the codes and a mask that is a bias (or a bool mask filling -inf) in one
    pass (:func:`exp_codes_bias`; :data:`BIAS_TABLE_MIN` says which), else in float32 (scores of another
    dtype than ``v``'s), then the product with one multiplier a row. ``plan``: :func:`softmax_matmul_step`'s."""
    out = None if plan is None else plan(q, v)
    if out is not None:
        return out
    dtype = v.dtype
    e_zp, mult = torch.iinfo(dtype).min, v_scale / out_scale  # e's codes: 0..255 above the dtype's least
    keep = biased = None
    if mask is not None:
        check_mask(mask, fill)
        is_bias = fill is None or fill == float("-inf")
        keep = table_keep(q, scale, mask, fill, -1, BIAS_TABLE_MIN if is_bias else TABLE_MIN)
        if keep is None and is_bias:  # apply_mask's floats, made in the pass
            biased = exp_codes_bias(q, zp, scale, mask if fill is None else as_bias(mask), mult, e_zp, dtype)
    if q.dtype == dtype and (mask is None or keep is not None):
        e, rmult = exp_codes(q, exp_table(scale) if table is None else table, keep, mult, e_zp, dtype)
    elif biased is not None:
        e, rmult = biased
    else:
        y = centered(q, zp).mul_(scale)
        e, rmult = exp_codes_float(y if mask is None else apply_mask(y, mask, fill), mult, e_zp, dtype)
    return matmul_rows(e, e_zp, v, v_zp, rmult, out_zp, *code_bounds(dtype, out_zp, "none"), dtype, rows)


def softmax_matmul_step(q, scale, zp, mask, fill, v, v_scale, v_zp, out_scale, out_zp, table=None, rows=None):
    """A program's plan of :func:`cpu_softmax_matmul` without a mask: its two native calls (``softmax_exp``'s codes
    and multipliers, then the product with a multiplier a row) as one native step, ``step(q, v)``, no Python between
    them (native_step.native_chain); None for other calls (the kernel's own route)."""
    dtype = v.dtype
    if (mask is not None or table is None or rows is None or q.dtype != dtype or not q.is_contiguous() or not q.numel()
            or tuple(rows.a_stride) != tuple(q.stride()) or not table.is_contiguous()):
        return None
    e_zp, n = torch.iinfo(dtype).min, q.shape[-1]
    exp = native.bind("softmax_exp", dtype, q.numel() // n, n, v_scale / out_scale, e_zp)
    product = native.bind("matmul", dtype, e_zp, v_zp, 0.0, out_zp, *code_bounds(dtype, out_zp, "none"))
    if exp is None or product is None:
        return None
    rmult = torch.empty(q.shape[:-1], device="meta").stride()
    out = torch.empty(rows.out_shape, device="meta").stride()
    return native_chain([(exp, [(IN, 0), None, table.data_ptr(), (BUFFER, 0), (BUFFER, 1)]),
                         (product, [(BUFFER, 0), (IN, 1), (BUFFER, 2), rows.geometry.data_ptr(), (BUFFER, 1)])],
                        [(q.shape, q.stride(), dtype), (v.shape, rows.b_stride, dtype)],
                        [(q.shape, q.stride(), dtype), (q.shape[:-1], rmult, torch.float32), (rows.out_shape, out, dtype)],
                        result=2, keep=(table, rows))
