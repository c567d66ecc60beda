"""int8 linears in lucid_fx's own GEMM (``native_gemm.c``), with oneDNN's values: on CPUs without VNNI,
and with it for the VNNI engine's small linears (:mod:`lucid_fx.kernels.linear_row`).

Without VNNI, oneDNN's int8 calls carry a large fixed cost (measured, 1 thread, AVX2 EPYC, torch
2.13, on prepacked weights: 48-51 us for a 16 x 64 x 64 linear, as its linear or as its 1x1
convolution, 66 us for a convolution of 8 channels on 4x4), and fbgemm, which torch.ao uses there,
is reachable only through ``quint8`` tensors. The native GEMM takes uint8 codes and 7-bit weights
(the grid of these CPUs, where int16 pair sums are exact) and fuses the float steps after the sums.
Against oneDNN's 1x1 convolution on a prepacked weight (its faster route for a linear there), in us,
calls from Python: 7.7 against 51 at 16 x 64 x 64, 32 against 79 at 1 x 1024 x 1024, 61 against 101
at 64 x 256 x 256, 767-1141 against 865-1077 at 64 x 1024 x 1024 (runs differ); slower past 2^26
multiply-adds (``linear_row.NATIVE_GEMM_MNK``).

The float steps are those of oneDNN's AVX2 kernels, one float32 rounding at a time:
``acc * (x_scale * w_scale) + bias`` with the two scales multiplied first (its VNNI kernels multiply
them one at a time: :mod:`lucid_fx.kernels.linear_row`), then ``rint(y / out_scale + zp)`` clamped.
tests/kernels/test_linear_row.py compares them with this machine's oneDNN where its AVX2 kernels
run, and with exact integer sums everywhere.

>>> qw = torch.tensor([[2, -1], [0, 3]], dtype=torch.int8)
>>> w = packed_weight(qw)
>>> gemm_rows(torch.tensor([[130, 126]], dtype=torch.uint8), w, -128 * w.row_sums, 1.0,
...           torch.tensor([0.5, 0.25]), None, 0.0, 0, -float('inf'), float('inf'), torch.float32)
tensor([[ 3.0000, -1.5000]])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple, Union

import torch

from lucid_fx.kernels.native import _function, bind
from lucid_fx.kernels.native_step import BUFFER, IN

__all__ = ["PackedWeight", "packed_weight", "gemm_rows", "gemm_into", "sum_available", "hardswish", "tanh_steps",
           "finish", "available", "full_grid", "amx", "use_amx", "amx_calls", "threaded", "takes_weight", "BLOCK", "STEP", "PAIR_SAFE", "POST",
           "kernel_post", "row_epilogue", "ADDEND", "Residual"]

# A residual the GEMM adds: a uint8 one's (scale, zero point), added before the requantization (oneDNN's "sum"
# post-op), or ADDEND: a float32 one of the result's layout, added to the float32 result (oneDNN's binary "add").
ADDEND = "add"
Residual = Union[Tuple[float, int], str]

BLOCK, STEP = 16, 4  # outputs per packed block, inputs per step (native_gemm.c's GEMM_NB, GEMM_KB)
# The largest weight magnitude whose int16 pair sums are exact: 2 * 255 * 64 <= 32767.
PAIR_SAFE = 64
# The post-ops the GEMM computes on y before its clamp or requantization, numbered as native_gemm.h's GEMM_POST_*.
POST = {"none": 0, "hardswish": 1, "tanh": 2}


def kernel_post(post_op: str) -> str:
    """The post-op the GEMM computes for a linear's ``post_op``: relu is the caller's clamp bounds."""
    return post_op if post_op in POST else "none"


@dataclass(frozen=True)
class PackedWeight:
    """An (N, K) int8 weight in native_gemm.c's blocks, with its row sums (for a zero point)."""

    packed: torch.Tensor  # int8 (ceil(N/16), ceil(K/4), 16, 4), zero-padded
    row_sums: torch.Tensor  # (N,) int32
    n: int
    k: int


def available() -> bool:
    """Whether this build has the vectorized GEMM (AVX2): the plain loop is correct but slow."""
    return bool(_function("gemm", "vectorized"))


def full_grid() -> bool:
    """Whether this build's sums are exact for every int8 weight: its GEMM steps are VNNI's
    ``vpdpbusd`` (AVX512-VNNI or AVX-VNNI), which sum four products in int32 at once."""
    return bool(_function("gemm", "full_grid"))


def amx() -> bool:
    """Whether this build's GEMM runs products of more than 8 rows (and inputs a multiple of 64) on AMX tiles
    (native_amx.c): built for a CPU with AMX-INT8, the tiles granted by Linux, not turned off (``LUCID_FX_AMX=0``
    or :func:`use_amx`). Its values are the VNNI kernels', bit for bit."""
    use = _function("amx", "use")
    return bool(use is not None and use(-1))


def use_amx(on: bool) -> bool:
    """Turn the AMX GEMM on or off for this process (tests and benchmarks compare the two); whether it is on."""
    use = _function("amx", "use")
    return bool(use is not None and use(int(bool(on))))


def amx_calls() -> int:
    """How many products this process ran on AMX tiles (tests and benchmarks see which kernel ran)."""
    calls = _function("amx", "calls")
    return 0 if calls is None else int(calls())


def threaded() -> bool:
    """Whether this build's GEMM runs on torch's threads (built with OpenMP; each output element one
    thread's, so the result is the same at any thread count)."""
    return bool(_function("gemm", "threaded"))


def takes_weight(qw: torch.Tensor) -> bool:
    """Whether this build's sums are exact for ``qw``'s codes: any with VNNI (:func:`full_grid`), else
    while they keep the int16 pair sums exact (``|w| <= PAIR_SAFE``)."""
    return bool(qw.numel() == 0 or full_grid() or (int(qw.min()) >= -PAIR_SAFE and int(qw.max()) <= PAIR_SAFE))


def packed_weight(w2d: torch.Tensor) -> PackedWeight:
    """``w2d`` (N, K) int8 in blocks of 16 outputs by 4 inputs: a copy, the weight's own storage untouched."""
    n, k = w2d.shape
    nb, kg = -(-n // BLOCK), -(-k // STEP)
    padded = torch.zeros(nb * BLOCK, kg * STEP, dtype=torch.int8)
    padded[:n, :k] = w2d
    packed = padded.view(nb, BLOCK, kg, STEP).permute(0, 2, 1, 3).contiguous()
    return PackedWeight(packed, w2d.sum(1, dtype=torch.int32), n, k)


def gemm_rows(q: torch.Tensor, weight: PackedWeight, offset: torch.Tensor, x_scale: float, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor], inv_out: float, zp: int, low: float, high: float,
              dtype: torch.dtype, post: str = "none") -> torch.Tensor:
    """``FINISH(((q @ w^T + offset) * x_scale) * w_scale + bias)`` for uint8 rows ``q`` (M, K): codes
    ``rint(clamp(y * inv_out + zp, low, high))`` of ``dtype``, or ``y`` clamped for float32; ``post``
    (:data:`POST`) on ``y`` first: oneDNN's hardswish (:func:`hardswish`) or tanh (:func:`tanh_steps`). Offsets are int32, scales and
    bias float32, one per output. Without the native kernels, torch computes the same values (an
    int64 matrix product, exact)."""
    q = q if q.is_contiguous() else q.contiguous()
    if _function("gemm", dtype) is not None:
        out = torch.empty((q.shape[0], weight.n), dtype=dtype)
        gemm_into(q, out, weight, offset, x_scale, w_scale, bias, inv_out, zp, low, high, dtype, post)
        return out
    w = weight.packed.permute(0, 2, 1, 3).reshape(-1, weight.packed.shape[1] * STEP)[:weight.n, :weight.k]
    acc = (q.to(torch.int64) @ w.to(torch.int64).T).to(torch.int32).add_(offset)
    y = acc.to(torch.float32).mul_(torch.tensor(x_scale, dtype=torch.float32)).mul_(w_scale)
    return finish(y if bias is None else y.add_(bias), inv_out, zp, low, high, dtype, post)


def gemm_into(q: torch.Tensor, out: torch.Tensor, weight: PackedWeight, offset: torch.Tensor, x_scale: float,
              w_scale: torch.Tensor, bias: Optional[torch.Tensor], inv_out: float, zp: int, low: float, high: float,
              dtype: torch.dtype, post: str = "none", accum: Optional[torch.Tensor] = None, sum_scale: float = 0.0,
              sum_zp: int = 0, addend: Optional[torch.Tensor] = None) -> bool:
    """:func:`gemm_rows` of the rows ``q``'s storage holds (M rows of K codes, dense: a 2-d tensor, or
    a channels-last image's pixels) into ``out``'s dense storage (M x N values of ``dtype``), whatever
    their shapes; False (nothing written) without the native kernels. ``accum``: uint8 codes laid out
    as ``out`` (a residual), added before the requantization as oneDNN's "sum" post-op adds them,
    ``fma(accum - sum_zp, sum_scale, y)`` (uint8 results only: :func:`sum_available`). ``addend``: float32 values
    laid out as ``out``, added to a float32 result after its clamp (oneDNN's binary "add": :data:`ADDEND`)."""
    assert (accum is None and addend is None) or post == "none", post
    residual = (sum_scale, sum_zp) if accum is not None else ADDEND if addend is not None else None
    gemm = gemm_call(q.numel() // weight.k, weight, offset, x_scale, w_scale, bias, inv_out, zp, low, high, dtype, post,
                     residual)
    if gemm is None:
        return False
    other = accum if accum is not None else addend
    gemm(q.data_ptr(), out.data_ptr(), *(() if other is None else (other.data_ptr(),)))
    return True


def gemm_call(m: int, weight: PackedWeight, offset: torch.Tensor, x_scale: float, w_scale: torch.Tensor,
              bias: Optional[torch.Tensor], inv_out: float, zp: int, low: float, high: float, dtype: torch.dtype,
              post: str = "none", residual: Optional[Residual] = None) -> Optional[Callable]:
    """:func:`gemm_into`'s native call for ``m`` rows with every argument but the rows' and the result's storage
    bound once (native.bind): ``gemm(q_ptr, out_ptr)``, or ``gemm(q_ptr, out_ptr, residual_ptr)`` with a
    ``residual`` (:data:`Residual`: uint8 codes' scale and zero point, or :data:`ADDEND` for a float32 result's
    addend). None without the native kernels."""
    kernel, tail = (("gemm", (POST[post],)) if residual is None else ("gemm_add", ()) if residual == ADDEND
                    else ("gemm_sum", residual))
    call = bind(kernel, dtype, m, weight.n, weight.k, x_scale, inv_out, zp, low, high, *tail)
    if call is None:
        return None
    packed, offset_p, scale_p = weight.packed.data_ptr(), offset.data_ptr(), w_scale.data_ptr()
    bias_p = None if bias is None else bias.data_ptr()

    def gemm(q_ptr: int, out_ptr: int, *accum_ptr: int) -> None:
        call(q_ptr, packed, out_ptr, offset_p, scale_p, bias_p, *accum_ptr)

    gemm.operands = (weight, offset, w_scale, bias)  # kept alive with the pointers bound
    # the same call as a native step's (native_step.py): the rows, the result and the residual by position
    residual_p = ((IN, 1),) if residual is not None else ()
    gemm.call, gemm.pointers = call, ((IN, 0), packed, (BUFFER, 0), offset_p, scale_p, bias_p, *residual_p)
    return gemm


def sum_available() -> bool:
    """Whether :func:`gemm_into` takes a residual (``accum``) here: the native kernels are loaded."""
    return _function("gemm_sum", torch.uint8) is not None


def hardswish(y: torch.Tensor) -> torch.Tensor:
    """oneDNN's hardswish post-op in float32, as its AVX2 kernels compute it (measured equal on every
    value): ``y * min(max(y * (1/6) + 1/2, 0), 1)``, one rounding per step (``F.hardswish`` rounds
    otherwise)."""
    gate = y * torch.tensor(1 / 6, dtype=torch.float32) + torch.tensor(0.5, dtype=torch.float32)
    return y * gate.clamp_(0.0, 1.0)


_F = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731  a float32 constant: torch rounds in float32
_TANH_P = [_F(c) for c in (-2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
                            1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03)]
_TANH_Q = [_F(c) for c in (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)]
_TANH_CLAMP = 7.90531110763549805


def tanh_steps(y: torch.Tensor) -> torch.Tensor:
    """The GEMM's tanh post-op (native_gemm.h's ``gemm_tanh1``: Eigen's rational approximation) as torch
    float32 steps, each rounded once, so equal to the native kernels' values: ``x * P(x^2) / Q(x^2)`` with
    ``x = y`` clamped to +-7.905, ``y`` itself below 0.0004 in magnitude; within 4 ulp of tanh."""
    x = y.clamp(-_TANH_CLAMP, _TANH_CLAMP)
    x2, p, q = x * x, _TANH_P[0], _TANH_Q[0]
    for c in _TANH_P[1:]:
        p = p * x2 + c
    for c in _TANH_Q[1:]:
        q = q * x2 + c
    return torch.where(y.abs() < 0.0004, y, p * x / q)


def finish(y: torch.Tensor, inv_out: float, zp: int, low: float, high: float, dtype: torch.dtype,
           post: str) -> torch.Tensor:
    """The torch path's steps after ``y = acc * scale + bias`` (float32): the post-op (:data:`POST`), then
    codes ``rint(clamp(y * inv_out + zp, low, high))`` of ``dtype``, or for a float result ``y`` clamped."""
    y = hardswish(y) if post == "hardswish" else tanh_steps(y) if post == "tanh" else y
    if dtype == torch.float32:
        return y.clamp_(low, high)
    y = y.mul_(torch.tensor(inv_out, dtype=torch.float32)).add_(torch.tensor(float(zp), dtype=torch.float32))
    return y.clamp_(low, high).round_().to(dtype)


def row_epilogue(acc: torch.Tensor, offset: torch.Tensor, x_scale: float, w_scale: torch.Tensor,
                 bias: Optional[torch.Tensor], inv_out: Optional[float], zp: int, low: float, high: float,
                 dtype: torch.dtype) -> Optional[torch.Tensor]:
    """:func:`lucid_fx.kernels.linear_row.linear_row`'s float steps (on the ``_int_mm`` route) after its int32 sums ``acc`` (rows,
    N), in one pass: the same values, bit for bit. None where the native kernels are not loaded or
    the operands are not dense (int32 sums and offsets, float32 scales and bias, on the CPU)."""
    fn = _function("row_epilogue", dtype)
    rows, cols = acc.shape
    if fn is None or not (acc.dtype == offset.dtype == torch.int32 and w_scale.dtype == torch.float32
                          and (bias is None or bias.dtype == torch.float32) and acc.is_cpu
                          and acc.is_contiguous() and offset.is_contiguous() and w_scale.is_contiguous()
                          and (bias is None or bias.is_contiguous())):
        return None
    out = torch.empty((rows, cols), dtype=dtype)
    fn(acc.data_ptr(), offset.data_ptr(), w_scale.data_ptr(), None if bias is None else bias.data_ptr(),
       out.data_ptr(), rows, cols, x_scale, 0.0 if inv_out is None else inv_out, zp, low, high)
    return out
