"""CPU kernels computed on the codes (add, mul and matmul in float32; softmax and masked softmax from a
table of exponentials, or in float32 for a mask that is a bias) and table lookups.

Each is the reference computation with fewer passes over memory: scales are folded into one
multiply, a zero point of 0 adds nothing, and softmax skips the zero point it is invariant to.
Codes can differ from the reference by one step where a value lies on a rounding tie (softmax:
where its table's 2**-24 moves one); the tests in ``tests/kernels/test_ops.py`` and
``test_softmax_native.py`` bound how often. Table lookups read two codes at a time
(:func:`lut`). Measured on 2 AVX2 cores for the encoder block's shapes, see each kernel.
"""

from typing import Callable, Optional

import torch

from lucid_fx.kernels import attention, native_elementwise, native_lut, norms, softmax_matmul, softmax_native
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.library import WeightCache, register_kernel
from lucid_fx.kernels.program_ops import centered, code_bounds, requantize_codes, softmax_table
from lucid_fx.kernels.native_step import returns_step

__all__ = ["PAIR_TABLES"]

# 65536-entry tables of code pairs, built once per 256-entry table (and input dtype).
PAIR_TABLES = WeightCache()


def _requantize(y: torch.Tensor, out_zp: int, post_op: str, dtype: torch.dtype) -> torch.Tensor:
    """Codes of ``y`` (already divided by the output scale): round, shift, clamp, narrow."""
    if post_op not in ("none", "relu"):  # only weighted ops fuse other post-ops (rules/fusions.py)
        raise ValueError(f"add and mul fuse post_op 'none' or 'relu', got {post_op!r}")
    return requantize_codes(y, out_zp, *code_bounds(dtype, out_zp, post_op), dtype)


def add(qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, post_op):
    """``a + b`` with the output scale folded into the input scales and relu as a clamp.

    One float temporary and two passes fewer than the reference: measured on 1x64x56x56 uint8,
    0.25 ms against 0.31 ms (add) and 0.24 against 0.30 ms (mul).
    """
    ref.check_post_op(post_op)
    ya = centered(qa, a_zp).mul_(a_scale / out_scale)
    y = torch.add(ya, centered(qb, b_zp), alpha=b_scale / out_scale)
    return _requantize(y, out_zp, post_op, qa.dtype)


def mul(qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp, post_op):
    """``a * b`` as ``(qa - za) * (qb - zb) * (sa * sb / s_out)`` (exact integer products in float32)."""
    ref.check_post_op(post_op)
    y = torch.mul(centered(qa, a_zp), centered(qb, b_zp))
    return _requantize(y.mul_(a_scale * b_scale / out_scale), out_zp, post_op, qa.dtype)


def matmul(qa, a_scale, a_zp, qb, b_scale, b_zp, out_scale, out_zp):
    """``(qa - za) @ (qb - zb)`` in float32 (exact products), times ``sa * sb / s_out`` once."""
    y = torch.matmul(centered(qa, a_zp), centered(qb, b_zp))
    return _requantize(y.mul_(a_scale * b_scale / out_scale), out_zp, "none", qa.dtype)


def softmax(q, scale, zp, dim, out_scale, out_zp):
    """Softmax of ``scale * q`` from a table of 256 exponentials (``program_ops.softmax_table``, each
    within ``2**-24`` of ``exp``) and exact integer sums, in one native pass where it is loaded
    (``softmax_native``): 0.65-0.8 against 0.9-1.2 ms for ``torch.softmax`` and a requantize on the
    encoder's 8x4x128x128 scores. Softmax ignores a constant shift, so the zero point is never subtracted."""
    low, high = code_bounds(q.dtype, out_zp, "none")
    return softmax_native.softmax_codes(q, softmax_table(scale), dim, 1.0 / out_scale, out_zp, low, high, q.dtype)


def masked_softmax(q, scale, zp, mask, fill, dim, out_scale, out_zp):
    """:func:`softmax` over the positions a padding or causal mask leaves (``program_ops.softmax_keep``),
    or, for a bias, in float32 with the mask applied first (lucid_fx/kernels/attention.py); the
    program makes the same call."""
    attention.check_mask(mask, fill)
    low, high = code_bounds(q.dtype, out_zp, "none")
    return softmax_native.masked_softmax_codes(q, scale, zp, mask, fill, dim, 1.0 / out_scale, out_zp, low, high, q.dtype)


def _pair_table(table: torch.Tensor, in_dtype: torch.dtype) -> torch.Tensor:
    """``pairs[b0 + 256 * b1] = table[c(b0)] + 256 * table[c(b1)]`` as int16 bit patterns, where
    ``c(b)`` is the table index of the code whose byte is ``b`` (``b ^ 128`` for int8 codes)."""
    byte = torch.arange(256)
    index = byte ^ 128 if in_dtype == torch.int8 else byte
    out = table.cpu().view(torch.uint8)[index].to(torch.int32)
    pairs = out.repeat(256) + (out.repeat_interleave(256) << 8)  # little-endian: first code is the low byte
    return pairs.to(torch.int16)  # values above 32767 wrap to the same bit pattern


# Codes: below this the pair table's setup costs more than a scalar native loop (a build without
# vector lookups). Its six torch ops lost to that loop up to 262144 codes on an AVX2 EPYC (36 against
# 13 us at 4096, 118 against 62 at 65536, 310 against 206 at 262144); on an AVX512-VNNI Xeon the pair
# table won at 1x32x112x112 (145 against 209).
PAIR_LOOKUP_MIN = 65536


@returns_step("q", "table")
def lut(q: torch.Tensor, table: torch.Tensor, plan: Optional[Callable] = None) -> torch.Tensor:
    """``table[code]``, reading the codes two at a time as one 16-bit index into a 65536-entry table
    of pairs (128 KiB, built once per table). Half the indices and no int64 copy: a million codes
    measured 0.49 ms against 1.05 ms for one lookup per code. Odd, small or non-dense tensors take
    the reference lookup. Where the native kernels are loaded, one C loop does what the pair table
    does not do faster: float tables (192 against 722 us for 1x32x112x112 codes) and small tensors
    (4.1 against 11.8-17.2 us for squeeze-excite's 96 gates), and 8-bit tables wherever the build
    has a vector path (``native_lut.lut_vectorized``: AVX512-VBMI or AVX2). Without one, 8-bit tables of
    ``PAIR_LOOKUP_MIN`` codes or more keep the pair table. ``plan``: :func:`lut_plan`'s."""
    looked_up = None if plan is None else plan(q, table)
    if looked_up is not None:
        return looked_up
    if table.dtype == torch.float32 or q.numel() < PAIR_LOOKUP_MIN or native_lut.lut_vectorized():
        looked_up = native_lut.lut(q, table)
        if looked_up is not None:
            return looked_up
    dense = q.is_contiguous() or q.is_contiguous(memory_format=torch.channels_last)
    if not (dense and q.numel() >= PAIR_LOOKUP_MIN and q.numel() % 2 == 0 and q.storage_offset() % 2 == 0
            and q.dtype in (torch.uint8, torch.int8) and table.numel() == 256
            and table.dtype in (torch.uint8, torch.int8)):
        return ref.lut(q, table)
    pairs = PAIR_TABLES.get(table, ("pairs", q.dtype), lambda: _pair_table(table, q.dtype))
    # A dense tensor's codes are q.numel() consecutive bytes from its storage offset, whatever its strides.
    flat = q.as_strided((q.numel(),), (1,)).view(torch.uint16)
    looked_up = torch.index_select(pairs, 0, flat.to(torch.int32)).view(table.dtype)
    return looked_up.as_strided(q.shape, q.stride())


def lut_plan(q: torch.Tensor, table: torch.Tensor) -> Optional[Callable]:
    """:func:`lut`'s native lookup for codes laid out as ``q`` (:func:`lucid_fx.kernels.native_lut.lut_plan`), where
    :func:`lut` would take it; None where the pair table serves."""
    if table.dtype == torch.float32 or q.numel() < PAIR_LOOKUP_MIN or native_lut.lut_vectorized():
        return native_lut.lut_plan(q, table)
    return None


register_kernel("add", "cpu", add)
register_kernel("mul", "cpu", mul)
register_kernel("matmul", "cpu", matmul)
register_kernel("softmax", "cpu", softmax)
register_kernel("masked_softmax", "cpu", masked_softmax)
register_kernel("softmax_matmul", "cpu", softmax_matmul.cpu_softmax_matmul)
register_kernel("lut", "cpu", lut)
register_kernel("channel_lut", "cpu", native_elementwise.channel_lut)  # one C pass where the native kernels are loaded
register_kernel("layer_norm", "cpu", norms.cpu_layer_norm)
register_kernel("rms_norm", "cpu", norms.cpu_rms_norm)
register_kernel("group_norm", "cpu", norms.cpu_group_norm)
