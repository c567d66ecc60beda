"""A dynamic linear: ``x @ W^T + b`` of float rows, ``x`` quantized to uint8 on its own range each call
(``per_batch_qparams``), int8 weight codes with per-row scales, float out. ``quantize_dynamic``'s
``nn.Linear`` and every recurrent layer's input-to-hidden product run it.

Three routes, the same values: where the native kernels are loaded and their GEMM takes the weight and the
size (:func:`~lucid_fx.kernels.linear_row.small_gemm`), one C call does all of it (native_rnn.c's
``lucid_linear_dynamic_float32``: the range, the codes, the zero point's offsets, the GEMM); with the native
GEMM but not that call, Python computes the qparams and calls the quantize and the GEMM; elsewhere (larger
products, other devices, int8 activations) ``torch.ops.lucid_fx.quantize_per_tensor`` and ``linear`` run.

Measured (benchmarks/dynamic_linear.py, AVX512-VNNI EPYC, 1 thread, us a call, fp32 / torch.ao / lucid_fx before
this call / with it): 1 x 256 -> 256 17.5 / 37.8 / 119 / 25.0; 1 x 1024 -> 1024 104 / 53.4 / 197 / 49.7; a small Llama's
32-token generate 147 / 150 / 222 / 131 ms. Before, two dispatcher calls into Python kernels (quantize, linear) and
a oneDNN call cost 100-190 us a call above the product: slower than fp32 at decoding.

>>> from lucid_fx.kernels.recurrent import recurrent_weight
>>> from lucid_fx.quantization.dtypes import quint8
>>> codes = torch.tensor([[2, -1], [0, 3]], dtype=torch.int8)
>>> weight = recurrent_weight(codes, torch.tensor([0.5, 0.25]), None)
>>> dynamic_linear(torch.tensor([[-128.0, 127.0]]), weight, quint8, "example")  # its grid: scale 1, zero point 128
tensor([[-191.5000,   95.2500]])
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from lucid_fx.kernels import linear_native, native
from lucid_fx.kernels.linear_row import small_gemm
from lucid_fx.kernels.native import _function
from lucid_fx.kernels.recurrent import RecurrentWeight
from lucid_fx.quantization.dtypes import QDtype
from lucid_fx.quantization.qparams import per_batch_qparams

__all__ = ["dynamic_linear", "one_call"]


def dynamic_linear(x: torch.Tensor, weight: RecurrentWeight, grid: QDtype, who: str) -> torch.Tensor:
    """``x @ W^T + b`` of float32 rows ``x`` (m, k), float out (m, n), ``x`` on the grid of its own min and max;
    inf or NaN in ``x`` raise a ValueError naming ``who``."""
    x = x.contiguous()  # dense rows: the native quantize writes codes in x's layout, and the GEMM reads rows
    (m, k), n = x.shape, weight.codes.shape[0]
    native_gemm = (weight.packed is not None and grid.storage == torch.uint8 and native.takes(x, torch.uint8)
                   and _function("gemm", torch.float32) is not None and small_gemm(m, n, k, "native"))
    if native_gemm:
        out = one_call(x, weight, grid, who)
        if out is not None:
            return out
    scale, zp = per_batch_qparams(x, grid, who)
    if native_gemm:  # quantize and GEMM called straight (a cell's one row: 94 -> 40 us, AVX512-VNNI EPYC)
        codes = native.quantize_codes(x, 1.0 / scale, zp, grid.quant_min, grid.quant_max, torch.uint8)  # ctypes rounds 1 / scale
        out = torch.empty(m, n)
        inf = float("inf")
        linear_native.gemm_into(codes, out, weight.packed, weight.offsets(zp), scale, weight.scale, weight.bias,
                                0.0, 0, -inf, inf, torch.float32)
        return out
    codes = torch.ops.lucid_fx.quantize_per_tensor(x, scale, zp, grid.quant_min, grid.quant_max, grid.storage)
    return torch.ops.lucid_fx.linear(codes, scale, zp, weight.codes, weight.scale, weight.bias, 1.0, 0, "none", torch.float32)


def one_call(x: torch.Tensor, weight: RecurrentWeight, grid: QDtype, who: str) -> Optional[torch.Tensor]:
    """:func:`dynamic_linear` of a dense float32 ``x`` in one native call (its other routes' values, bit for bit),
    for a weight the native GEMM takes on uint8 codes; None (nothing done) where the call is not loaded or ``x`` is
    not dense float32."""
    fn = _function("linear_dynamic", torch.float32)
    if fn is None or x.dtype != torch.float32 or not x.is_contiguous():
        return None
    (m, k), n = x.shape, weight.codes.shape[0]
    out = torch.empty(m, n)
    work = torch.empty(-(-m * k // 64) * 64 + 4 * n, dtype=torch.uint8)  # the codes, then the offsets
    if fn(x.data_ptr(), weight.packed.packed.data_ptr(), weight.packed.row_sums.data_ptr(), weight.scale.data_ptr(),
          None if weight.bias is None else weight.bias.data_ptr(), out.data_ptr(), work.data_ptr(),
          _geometry(m, k, n, grid.quant_min, grid.quant_max).data_ptr()):
        raise ValueError(f"{who}: the input holds inf or nan; a per-batch range needs finite values")
    return out


@functools.lru_cache(maxsize=256)
def _geometry(m: int, k: int, n: int, qmin: int, qmax: int) -> torch.Tensor:
    """The call's geometry (int64, read only), made once per shape (torch.tensor costs 6 us a call)."""
    return torch.tensor([m, k, n, qmin, qmax], dtype=torch.int64)
