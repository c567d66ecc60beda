"""``lucid_fx::grouped_linear``: a mixture of experts' grouped product on int8 codes.

Mixtral's experts (transformers' ``grouped_mm``, ``torch._grouped_mm``) sort the token rows by
expert and multiply each expert's rows by that expert's weight: rows ``offs[e-1]:offs[e]`` of the
(S, K) input times expert ``e``'s (K, N). Here the weight is stored as a linear's, (E, N, K) int8
codes with one scale per (expert, output channel), and each expert's rows run through
``lucid_fx::linear``: the device's own int8 linear (oneDNN on CPU, ``torch._int_mm`` on CUDA), or
the reference one. Rows past ``offs[-1]`` are zero (its zero point's code), as transformers'
fallback leaves them. The offsets are read once per call (one device sync on CUDA).

>>> qx = torch.randint(0, 256, (5, 8), dtype=torch.uint8)
>>> qw = torch.randint(-64, 64, (2, 3, 8), dtype=torch.int8)
>>> y = torch.ops.lucid_fx.grouped_linear(qx, 0.02, 128, qw, torch.full((2, 3), 0.01), torch.tensor([2, 5]), 0.05, 128)
>>> one = torch.ops.lucid_fx.linear(qx[2:], 0.02, 128, qw[1], torch.full((3,), 0.01), None, 0.05, 128, "none", None)
>>> y.shape, bool((y[2:] == one).all())
(torch.Size([5, 3]), True)
"""

from typing import Callable

import torch

from lucid_fx.kernels import cpu
from lucid_fx.kernels import linear_row as lr
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.checks import fail
from lucid_fx.kernels.library import KERNELS, WeightCache, define_op, register_kernel

__all__ = ["grouped_linear", "fake_grouped_linear", "EXPERTS"]

# Each weight's experts as views, built once per weight: a device's linear caches its packed weight
# by the tensor it is given (WeightCache), so the same view must come back on every call.
EXPERTS = WeightCache()


def _experts(qw: torch.Tensor, w_scale: torch.Tensor):
    return EXPERTS.get(qw, ("experts", id(w_scale)), lambda: (qw.unbind(0), w_scale.unbind(0)))


def _ends(qx: torch.Tensor, offs: torch.Tensor) -> list:
    ends = offs.tolist()
    if any(b < a for a, b in zip([0] + ends, ends)) or ends[-1] > qx.shape[0]:
        fail("grouped_linear", f"the offsets {ends[:8]}{'...' if len(ends) > 8 else ''} do not rise from 0 to at most the "
             f"{qx.shape[0]} rows", "pass the cumulative row count of each expert, rows sorted by expert")
    return ends


def _grouped(linear: Callable, qx, x_scale, x_zp, qw, w_scale, offs, out_scale, out_zp) -> torch.Tensor:
    out = torch.full((qx.shape[0], qw.shape[1]), out_zp, dtype=qx.dtype, device=qx.device)
    weights, scales = _experts(qw, w_scale)
    ends = _ends(qx, offs)
    start = 0
    for expert, end in enumerate(ends):
        if end > start:
            out[start:end] = linear(qx[start:end], x_scale, x_zp, weights[expert], scales[expert], None, out_scale,
                                    out_zp, "none", None)
        start = end
    return out


def grouped_linear(
    qx: torch.Tensor, x_scale: float, x_zp: int, qw: torch.Tensor, w_scale: torch.Tensor, offs: torch.Tensor,
    out_scale: float, out_zp: int,
) -> torch.Tensor:
    """Rows ``offs[e-1]:offs[e]`` of ``qx`` times expert ``e``'s weight, quantized with ``(out_scale, out_zp)``.

    Args:
        qx: activation codes (S, K), uint8 (or int8), per-tensor ``(x_scale, x_zp)``, sorted by expert.
        qw: weight codes (E, N, K), int8, zero points 0; ``w_scale`` (E, N) float.
        offs: (E,) integer, non-decreasing, each at most S: where each expert's rows end.
    """
    return _grouped(ref.linear, qx, x_scale, x_zp, qw, w_scale, offs, out_scale, out_zp)


def fake_grouped_linear(qx, x_scale, x_zp, qw, w_scale, offs, out_scale, out_zp):
    return torch.empty((qx.shape[0], qw.shape[1]), dtype=qx.dtype, device=qx.device)


def _on(device: str) -> Callable:
    """The grouped product whose experts run on ``device``'s ``lucid_fx::linear`` kernel (looked up per
    call: the CPU kernel may be swapped, as the benchmarks do)."""
    def kernel(qx, x_scale, x_zp, qw, w_scale, offs, out_scale, out_zp):
        return _grouped(KERNELS["linear"][device], qx, x_scale, x_zp, qw, w_scale, offs, out_scale, out_zp)

    return kernel


def _cpu(qx, x_scale, x_zp, qw, w_scale, offs, out_scale, out_zp):
    """On the CPU, where the small-linear engine takes every expert's rows (``linear_row.takes_row`` at
    all S rows: each expert has at most S), each expert's constants are built once per call site and
    kept with the weight: ``lucid_fx::linear`` built them on every call (792 against 117 us for four
    experts of 256 outputs by 64 inputs on 64 rows, AVX2 EPYC, 1 thread). The codes are that linear's, bit for bit."""
    experts, n, k = qw.shape
    target = cpu._cpu_target()  # an AMX CPU: each expert's linear, whose steps follow its own row count
    engine = qx.dtype == torch.uint8 and target.row_limit is None and lr.takes_row(target, cpu._onednn_on(), "none",
                                                                                   torch.uint8, qx.shape[0], n, k)
    key = ("rows", id(w_scale), w_scale._version, x_scale, x_zp, out_scale, engine)
    rows = engine and EXPERTS.get(qw, key, lambda: [lr.row_linear(w, s, None, x_scale, x_zp, out_scale, engine)
                                                    for w, s in zip(*_experts(qw, w_scale))])
    if not rows or any(row is None for row in rows):
        return _grouped(KERNELS["linear"]["cpu"], qx, x_scale, x_zp, qw, w_scale, offs, out_scale, out_zp)
    ends = _ends(qx, offs)
    out = torch.full((qx.shape[0], n), out_zp, dtype=torch.uint8) if ends[-1] < qx.shape[0] else torch.empty(
        (qx.shape[0], n), dtype=torch.uint8)  # rows past the last offset keep the zero point's code
    bounds = lr.row_bounds(torch.uint8, out_zp, "none")
    dense = qx.is_contiguous()
    start = 0
    for row, end in zip(rows, ends):
        # lucid_fx's GEMM writes an expert's rows in place, where a copy took them (four experts of 256 x 64 or
        # 64 x 128 on 64 rows: 0.72-0.76 of the time, 58 -> 45 us, the two taking turns, AVX512-VNNI EPYC)
        if end > start and not (dense and lr.gemm_into(qx[start:end], out[start:end], row, out_zp, *bounds, torch.uint8)):
            out[start:end] = lr.linear_row(qx[start:end], row, out_zp, *bounds, torch.uint8)
        start = end
    return out


define_op(grouped_linear, fake_grouped_linear)
register_kernel("grouped_linear", "cpu", _cpu)
register_kernel("grouped_linear", "cuda", _on("cuda"))
