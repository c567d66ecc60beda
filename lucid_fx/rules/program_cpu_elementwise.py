"""Program rules for the CPU's elementwise steps: the float boundary, table lookups, add, mul, cat and norms.

Rules as in :mod:`lucid_fx.rules.program_cpu` (whose table includes these): ``rule(b, node)`` returns
the program node computing the same codes, or None to decline. Run-time steps come from
:mod:`lucid_fx.kernels.native` (one C pass) where it is loaded, else from
:mod:`lucid_fx.kernels.program_ops` (torch ops, the same values).
"""

from __future__ import annotations

import operator
from typing import Callable, Dict, Optional

import torch
from torch import fx

from lucid_fx.kernels import (cpu_float, native, native_elementwise, native_lut, native_rotary, native_squeeze_excite, norms,
                              program_ops)
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.channel_lut import code_index
from lucid_fx.kernels.reference import dequant, f32_reciprocal

__all__ = ["PROGRAM_RULES_CPU_ELEMENTWISE", "step"]


def step(name: str) -> Callable:
    """The run-time function ``name``: lucid_fx.kernels.native's one C pass where the native kernels
    are loaded, else program_ops' torch ops (the same values; both modules define it)."""
    return getattr(native if native.available() else program_ops, name)


def quantize_per_tensor(b, node):  # lucid_fx.quantize_per_tensor -> one native pass, or 4-5 torch ops; NaN check included
    x, scale, zp, qmin, qmax, dtype = node.args
    if b.value(x).dtype != torch.float32:
        return None
    if native.available() and _read_channels_last(b, node):  # an image into a convolution: codes written channels-last
        return b.call(native_elementwise.quantize_channels_last, x, f32_reciprocal(scale), zp, qmin, qmax, dtype)
    return b.call(step("quantize_codes"), x, f32_reciprocal(scale), zp, qmin, qmax, dtype)


def _read_channels_last(b, node) -> bool:
    """Whether contiguous 4-d codes of ``node`` are only read by a copy to channels-last (the layout
    pass puts one before a convolution), which is then a no-op."""
    value, users = b.value(node), list(node.users)
    planes = value is not None and value.dim() == 4 and value.is_contiguous()
    return (planes and not value.is_contiguous(memory_format=torch.channels_last) and len(users) == 1
            and users[0].op == "call_method" and users[0].target == "contiguous"
            and users[0].kwargs.get("memory_format") == torch.channels_last and len(users[0].args) == 1)


def _index(table: torch.Tensor) -> torch.Tensor:
    """A table of codes as indices into the next table."""
    return code_index(table).long()


def lut(b, node):  # lut(lut(q, t1), t2) -> lut(q, t2[t1]); lut(channel_lut(q, T), t2) -> channel_lut(q, t2[T])
    inner, outer_table = node.args
    if _group_norm(b, inner):  # a SiLU after a group norm: its table is the norm's tail
        return _with_tail(b, inner, lambda codes: b.attr(outer_table)[_index(codes)])
    if b.op_name(inner) not in ("lut", "channel_lut") or len(inner.users) != 1:
        return None
    q, inner_table, *dim = inner.args
    composed = b.attr(outer_table)[_index(b.attr(inner_table))].contiguous()  # a relu after a batch norm: one pass
    if inner.target is native_elementwise.channel_lut_cat:  # the same lookup of the cat's parts
        return b.call(native_elementwise.channel_lut_cat, q, b.const(composed, "tables"))
    if dim:
        return b.call(b.kernel("channel_lut"), q, b.const(composed, "tables"), *dim)
    return b.call(b.kernel("lut"), q, b.const(composed, "lut"))


def _binary_args(b, node):
    qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, post_op = node.args
    a, other, out = b.value(qa), b.value(qb), b.value(node)
    if a.dtype not in (torch.uint8, torch.int8) or other.dtype != a.dtype or out.dtype != a.dtype or post_op not in (
            "none", "relu"):
        return None
    bounds = program_ops.code_bounds(a.dtype, out_zp, post_op)
    return qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, bounds, a.dtype


def add(b, node):  # lucid_fx.add on the CPU -> program_ops.add_codes: multipliers once, no float32 -> 8-bit cast
    found = _binary_args(b, node) if b.kernel("add") is cpu_float.add else None
    if found is None:
        return None
    qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, (low, high), dtype = found
    mults = a_scale / out_scale, b_scale / out_scale
    plan = native_elementwise.broadcast_plan(b.value(qa), b.value(qb), b.value(node)) if (
        native.available() and native_elementwise.fused_add()) else None
    if plan is not None:  # any strides and broadcast (rotary embedding's sum, a residual): one pass
        rotary = _rotary(b, node, qa, qb, (a_zp, mults[0], b_zp, mults[1], out_zp, low, high))
        if rotary is not None:
            return rotary
        return b.call(native_elementwise.add_codes, qa, a_zp, mults[0], qb, b_zp, mults[1], out_zp, low, high, dtype,
                      b.const(plan, "plan"))
    return b.call(program_ops.add_codes, qa, a_zp, mults[0], qb, b_zp, mults[1], out_zp, low, high, dtype)


def _only_user(b, node, target) -> bool:
    """Whether ``node`` calls ``target`` and one live node reads it (a node another rule left without
    users, such as the negation a cat's table took in, goes at the rewrite's end)."""
    return isinstance(node, fx.Node) and node.target is target and len([u for u in node.users if u.users]) == 1


def _half(b, node, x) -> Optional[str]:
    """"lo" or "hi" for ``x[..., :h]`` or ``x[..., h:]`` (h half of x's last dim), written with an
    ellipsis or a full slice per leading dim."""
    if not (isinstance(node, fx.Node) and node.target is operator.getitem and node.args[0] is x
            and isinstance(node.args[1], tuple) and node.args[1]):
        return None
    *lead, last = node.args[1]
    h = b.value(x).shape[-1] // 2
    if lead != [Ellipsis] and (len(lead) + 1 != b.value(x).dim() or any(i != slice(None) for i in lead)):
        return None
    if not isinstance(last, slice):
        return None
    return {(None, h, None): "lo", (h, None, None): "hi"}.get((last.start, last.stop, last.step))


def _rotated_half(b, part, x):
    """(which half of ``x``, the table node) for a part of rotate_half's cat: ``lut(x[..., half])``,
    or the half itself where it is on the cat's grid (an identity table)."""
    if _only_user(b, part, b.kernel("lut")):
        table = b.attr(part.args[1])
        if table is not None and table.dtype == b.value(x).dtype and table.numel() == 256:
            return _half(b, part.args[0], x), part.args[1]
        return None, None
    if _only_user(b, part, operator.getitem):
        return _half(b, part, x), b.const(_all_codes(b.value(x).dtype), "lut")  # codes in table order: the identity
    return None, None


def _rotary(b, node, qa, qb, add_numbers):
    """Llama's ``x * cos + rotate_half(x) * sin`` in one call (lucid_fx/kernels/native_rotary.py) where
    ``qa + qb`` is that sum of two products of the native kernels nothing else reads: ``x * c`` and
    ``cat([lut(x[..., h:]), lut(x[..., :h])]) * s`` (a half on the cat's grid without its lookup)."""
    for first, (m1, m2) in ((True, (qa, qb)), (False, (qb, qa))):
        if not (_only_user(b, m1, native_elementwise.mul_codes) and _only_user(b, m2, native_elementwise.mul_codes)):
            continue
        x, r = m1.args[0], m2.args[0]
        if not (_only_user(b, r, torch.cat) and len(r.args[0]) == 2 and r.args[1] in (-1, b.value(r).dim() - 1)):
            continue
        (hi, t_hi), (lo, t_lo) = (_rotated_half(b, part, x) for part in r.args[0])
        if (hi, lo) != ("hi", "lo"):
            continue
        plan = native_rotary.rotary_plan(b.value(x), b.value(m1.args[2]), b.value(m2.args[2]), b.value(node),
                                         tuple(m1.args[1:2]) + tuple(m1.args[3:8]), tuple(m2.args[1:2]) + tuple(m2.args[3:8]),
                                         add_numbers, first)
        if plan is not None:
            return b.call(native_rotary.rotary_codes, x, m1.args[2], m2.args[2], t_hi, t_lo, b.const(plan, "rotary"))
    return None


def mul(b, node):  # lucid_fx.mul on the CPU -> program_ops.mul_codes: the multiplier once, no float32 -> 8-bit cast
    found = _binary_args(b, node) if b.kernel("mul") is cpu_float.mul else None
    if found is None:
        return None
    qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, (low, high), dtype = found
    mult = a_scale * b_scale / out_scale
    looked_up = _lookups(b, qa, qb, dtype) if native.available() else None
    if looked_up is not None:  # a gated MLP's act(x) * gate(y): both lookups and the product in one pass
        (ca, ta), (cb, tb) = looked_up
        return b.call(native_lut.lut_mul_codes, ca, ta, a_zp, cb, tb, b_zp, mult, out_zp, low, high, dtype)
    if native_squeeze_excite.is_gate(b.value(qb), b.value(qa)):  # gate * x: the product of two codes commutes exactly
        qa, a_zp, qb, b_zp = qb, b_zp, qa, a_zp
    if native.available() and native_squeeze_excite.is_gate(b.value(qa), b.value(qb)):
        return b.call(native_squeeze_excite.gate_mul_codes, qa, a_zp, qb, b_zp, mult, out_zp, low, high, dtype)
    plan = native_elementwise.broadcast_plan(b.value(qa), b.value(qb), b.value(node)) if native.available() else None
    if plan is not None:  # any strides and broadcast (a rotary q * cos, a layer scale): one pass
        return b.call(native_elementwise.mul_codes, qa, a_zp, qb, b_zp, mult, out_zp, low, high, dtype, b.const(plan, "plan"))
    return b.call(program_ops.mul_codes, qa, a_zp, qb, b_zp, mult, out_zp, low, high, dtype)


def _lookups(b, qa, qb, dtype):
    """The codes and tables of ``lut(ca, ta)`` and ``lut(cb, tb)``, if ``qa`` and ``qb`` are such
    lookups of one shape and layout that nothing else reads (None otherwise)."""
    found = []
    for q in (qa, qb):
        if b.op_name(q) != "lut" or len(q.users) != 1 or _group_norm(b, q):  # (a lut that became a norm's tail)
            return None
        codes, table = q.args
        found.append((codes, table))
    (ca, ta), (cb, tb) = found
    a, c = b.value(ca), b.value(cb)
    if a.shape != c.shape or a.stride() != c.stride() or any(
            t is None or t.dtype != dtype or t.numel() != 256 for t in (b.attr(ta), b.attr(tb))):
        return None
    return found


def dequantize_per_tensor(b, node):  # dequantize(lut(q, t)) -> lut(q, dequantize(t)): a float table, one pass
    q, scale, zp = node.args
    if _group_norm(b, q):  # a group norm's codes read as floats: its tail is a float table
        return _with_tail(b, q, lambda codes: dequant(codes, scale, zp).contiguous())
    if b.op_name(q) not in ("lut", "channel_lut") or len(q.users) != 1:
        return b.call(native_elementwise.dequantize_codes, q, scale, zp) if native.available() else None
    codes, table, *dim = q.args
    floats = dequant(b.attr(table), scale, zp).contiguous()  # the same float32 arithmetic, once per table entry
    if dim:
        return b.call(b.kernel("channel_lut"), codes, b.const(floats, "tables"), *dim)
    return b.call(b.kernel("lut"), codes, b.const(floats, "lut"))


def _all_codes(dtype: torch.dtype) -> torch.Tensor:
    """Every code of ``dtype`` in table order (int8 from -128: ``lucid_fx::lut``'s index)."""
    info = torch.iinfo(dtype)
    return torch.arange(info.min, info.max + 1).to(dtype)


def cat(b, node):  # cat of codes -> torch.cat, an input on another grid through its 256-entry table first
    qs, scales, zps, dim, out_scale, out_zp = node.args
    dtype = b.value(node).dtype
    if dtype not in (torch.uint8, torch.int8) or any(b.value(q).dtype != dtype for q in qs):
        return None
    parts = []
    for q, scale, zp in zip(qs, scales, zps):
        if (scale, zp) == (out_scale, out_zp):
            parts.append(q)
            continue
        # The reference requantization of every code, once: the same arithmetic per element.
        table = ref.cat([_all_codes(dtype)], [scale], [zp], 0, out_scale, out_zp)
        # (a lut composed with a batch norm's tables before it is a channel_lut: its tables are per channel)
        if b.op_name(q) == "lut" and len(q.args) == 2 and len(q.users) == 1 and b.attr(q.args[1]) is not None:
            q, inner = q.args  # rotate_half's cat((-x2, x1)): the negation and the requantization, one table
            table = table[_index(b.attr(inner))]
        parts.append(b.call(b.kernel("lut"), q, b.const(table.contiguous(), "lut")))
    return b.call(torch.cat, parts, dim)


def channel_lut(b, node):  # channel_lut(cat([lut(x, t), y]), T) -> channel_lut_cat([x, y], T composed with t)
    q, tables, dim = node.args
    value, table = b.value(q), b.attr(tables)
    dim = dim % value.dim()
    if not (b.op_name(q) == "cat" and q.target is torch.cat and len(q.users) == 1 and table is not None
            and q.args[1] % value.dim() == dim):
        return None
    parts, rows, start = [], [], 0
    for part in q.args[0]:
        looked_up = part.target is b.kernel("lut") and len(part.users) == 1 and b.attr(part.args[1]) is not None
        codes = part.args[0] if looked_up else part
        width = b.value(codes).shape[dim]
        block = table[start:start + width]
        rows.append(block[:, _index(b.attr(part.args[1]))] if looked_up else block)  # a requantization, composed
        parts.append(codes)
        start += width
    tables = b.const(torch.cat(rows).contiguous(), "tables")
    if native.available() and dim == 1 and all(_channels_last(b.value(part)) for part in parts):
        return b.call(native_elementwise.channel_lut_cat, parts, tables)  # one pass over the parts: no cat
    return b.call(b.kernel("channel_lut"), b.call(torch.cat, parts, q.args[1]), tables, dim)


def _channels_last(value) -> bool:
    return value.dim() == 4 and value.is_contiguous(memory_format=torch.channels_last)


def _group_norm(b, node) -> bool:
    """Whether ``node`` is the program's group norm (:func:`group_norm`; with a lut after it as its tail,
    the program node of that lut), read by one node."""
    return getattr(node, "target", None) is norms.cpu_group_norm and len(node.users) == 1


def _with_tail(b, norm, compose: Callable[[torch.Tensor], torch.Tensor]):
    """``norm`` with ``compose`` applied to its output codes in its tail table: one lookup pass less."""
    args, tail = norm.args[:9], b.attr(norm.args[9]) if len(norm.args) > 9 else None
    codes = _all_codes(b.value(norm).dtype) if tail is None else tail
    return b.call(norms.cpu_group_norm, *args, b.const(compose(codes), "lut"))


def layer_norm(b, node):  # lucid_fx.layer_norm -> norms.cpu_layer_norm without the dispatcher: one native pass
    return b.call(norms.cpu_layer_norm, *node.args)


def rms_norm(b, node):  # lucid_fx.rms_norm -> norms.cpu_rms_norm without the dispatcher
    return b.call(norms.cpu_rms_norm, *node.args)


def group_norm(b, node):  # lucid_fx.group_norm -> norms.cpu_group_norm without the dispatcher (a lut after it joins it)
    return b.call(norms.cpu_group_norm, *node.args)


PROGRAM_RULES_CPU_ELEMENTWISE: Dict[str, Callable[..., Optional[fx.Node]]] = {
    "quantize_per_tensor": quantize_per_tensor,  # -> native.quantize_codes, or program_ops.quantize_codes
    "lut": lut,  # lut(lut(q)) -> one composed table
    "add": add,  # -> native_elementwise.add_codes, or program_ops.add_codes (cpu_float.add's arithmetic)
    "mul": mul,  # -> native_squeeze_excite.gate_mul_codes, native_elementwise.mul_codes, or program_ops.mul_codes
    "dequantize_per_tensor": dequantize_per_tensor,  # dequantize(lut(q)) -> a float table; else one native pass
    "cat": cat,  # -> torch.cat; inputs on other grids through a requantizing table
    "channel_lut": channel_lut,  # after such a cat: the parts' tables composed into the channels' tables
    # (and lut(channel_lut) / dequantize(channel_lut) compose in the lut and dequantize rules above)
    "layer_norm": layer_norm,  # -> the CPU kernel itself (native_norm.c's pass), the dispatcher skipped
    "rms_norm": rms_norm,
    "group_norm": group_norm,  # -> native_norm.c's two passes; a following lut or dequantize is its tail table
}
