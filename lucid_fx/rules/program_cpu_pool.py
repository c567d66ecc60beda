"""Program rules for the CPU's pools of codes: max, average and global average.

Rules as in :mod:`lucid_fx.rules.program_cpu` (whose table includes these): ``rule(b, node)`` returns
the program node computing the same codes, or None to decline. Max and average pools of 4-d codes
run native_pool.c's one pass (:mod:`lucid_fx.kernels.native_pool`), planned here for the recorded
input signature; a global average pool is an int32 sum and one requantization.
"""

from __future__ import annotations

from typing import Callable, Dict, Optional

from torch import fx

from lucid_fx.kernels import native, native_pool, native_squeeze_excite, program_ops

__all__ = ["PROGRAM_RULES_CPU_POOL"]


def max_pool2d(b, node):  # max_pool2d of codes -> native_pool.c, or the maximum of strided views
    q, kernel, stride, padding, dilation, ceil_mode = node.args
    kernel = list(kernel)
    stride = list(stride) if stride else kernel
    if b.value(q).dim() != 4 or not program_ops.max_pool_taps_supported(kernel, stride, list(padding), list(dilation),
                                                                         ceil_mode):
        return None
    plan = native_pool.pool_plan(b.value(q), b.value(node), "max", kernel, stride, list(padding)) if native.available() else None
    if plan is None:
        return b.call(program_ops.max_pool_taps, q, kernel, stride, list(padding))
    return _pool(b, q, plan)


def avg_pool2d(b, node):  # avg_pool2d of codes -> native_pool.c: int32 sums, one requantization
    q, scale, zp, kernel, stride, padding, ceil_mode, include_pad, out_scale, out_zp = node.args
    kernel = list(kernel)
    stride = list(stride) if stride else kernel
    if ceil_mode or not native.available():  # ceil mode's partial windows: the reference kernel
        return None
    kind = "avg_with_pad" if include_pad else "avg"
    plan = native_pool.pool_plan(b.value(q), b.value(node), kind, kernel, stride, list(padding), (scale, zp, out_scale, out_zp))
    return None if plan is None else _pool(b, q, plan)


def _pool(b, q, plan):  # the native pool, planned as a native step
    step = native_pool.pool_step(plan, b.value(q).dtype)
    return b.call(native_pool.pool_codes, q, b.const(plan, "pool"), *(() if step is None else (b.const(step, "step"),)))


def adaptive_avg_pool2d(b, node):  # global average pool of codes -> an int32 sum and one requantization
    q, scale, zp, size, out_scale, out_zp = node.args
    value = b.value(q)
    if list(size) != [1, 1] or value.dim() != 4:
        return None
    return b.call(_global_avg_pool(), q, scale, zp, out_scale, out_zp)


def _global_avg_pool() -> Callable:
    """One native pass where the native kernels are loaded, else program_ops' torch ops (the same codes)."""
    return native_squeeze_excite.global_avg_pool_codes if native.available() else program_ops.global_avg_pool_codes


def mean(b, node):  # mean over H and W of 4-d codes (timm's squeeze-excite) -> the global average pool
    q, scale, zp, dim, keepdim, out_scale, out_zp = node.args
    value = b.value(q)
    if value.dim() != 4 or sorted(d % 4 for d in dim) != [2, 3]:
        return None
    pooled = b.call(_global_avg_pool(), q, scale, zp, out_scale, out_zp)
    return pooled if keepdim else b.call_method("reshape", pooled, tuple(value.shape[:2]))


PROGRAM_RULES_CPU_POOL: Dict[str, Callable[..., Optional[fx.Node]]] = {
    "max_pool2d": max_pool2d,  # -> native_pool.pool_codes / program_ops.max_pool_taps
    "avg_pool2d": avg_pool2d,  # -> native_pool.pool_codes (int32 sums), else the reference kernel
    "adaptive_avg_pool2d": adaptive_avg_pool2d,  # to 1x1 -> native / program_ops.global_avg_pool_codes
    "mean": mean,  # over H and W -> the same global average pool
}
