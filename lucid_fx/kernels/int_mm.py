"""Integer GEMM kernels on ``torch._int_mm``, device-neutral: CUDA's kernels (:mod:`lucid_fx.kernels.cuda`
registers them) and the CPU path where oneDNN is absent or would not be exact.

``torch._int_mm(a, b)`` multiplies int8 matrices into int32. On CUDA (cuBLASLt) it needs
``a.size(0) > 16`` and K, N multiples of 8, so operands are zero-padded and the result sliced
(:func:`pad_for_int_mm`); zero rows and columns add nothing to the products. The CPU version
takes any shape, so padding is off there.

uint8 activations are shifted into int8 (``x - 128``, a flip of the sign bit); with weight row
sums ``r`` the zero point comes back exactly: ``sum (x - zx) w = sum (x - 128) w + (128 - zx) r``.
The int32 accumulators are then rescaled by ``x_scale * w_scale``, biased, and requantized.

Convolutions with ``groups == 1`` run as im2col in NHWC order plus this GEMM (the GEMM's rows
are output pixels, so the result is channels-last for free). Grouped and depthwise
convolutions run as a float32 convolution on the integer values ``x - zx`` and ``w``: each
product is exact (|values| <= 255, exact even in TF32), and looping one tiny GEMM per group
would be slower.

>>> a = torch.randint(-128, 128, (5, 13), dtype=torch.int8)
>>> b = torch.randint(-128, 128, (13, 7), dtype=torch.int8)
>>> a_p, b_p, m, n = pad_for_int_mm(a, b)
>>> tuple(a_p.shape), tuple(b_p.shape), m, n
((17, 16), (16, 8), 5, 7)
>>> torch.equal(int_mm_padded(a, b), (a.long() @ b.long()).int())
True

On a CPU without VNNI, oneDNN's ``torch._int_mm`` adds pairs of products in int16 with saturation
(measured with ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``AVX512_CORE``: wrong for a right operand beyond
``[-64, 64]``, exact within it), so there a wider right operand is split into two halves within
that range (:func:`split_for_int16_pairs`) and multiplied twice: exact, at twice the cost.
"""

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

from lucid_fx.kernels import cuda_fused
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.cpu_features import detected_cpu_features
from lucid_fx.kernels.library import WeightCache
from lucid_fx.kernels.target import resolve_target

__all__ = [
    "int_mm_padding", "pad_for_int_mm", "int_mm_padded", "split_for_int16_pairs", "int8_linear", "int8_conv",
    "PREPARED", "as_int8", "linear_weight", "raw_gemm", "conv_gemm",
]
# The widest right operand oneDNN's int16 pair sums hold on CPUs without VNNI: 2 * 255 * 64 <= 32767.
PAIR_SAFE = 64

# Weights in GEMM form (column-major, maybe padded) with their row sums, once per weight.
PREPARED = WeightCache()


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def int_mm_padding(m: int, k: int, n: int) -> Tuple[int, int, int]:
    """Padded ``(M, K, N)`` that CUDA's ``torch._int_mm`` accepts: M > 16, K and N multiples of 8.

    >>> int_mm_padding(1, 3, 7), int_mm_padding(64, 16, 8)
    ((17, 8, 8), (64, 16, 8))
    """
    return max(m, 17), _round_up(k, 8), _round_up(n, 8)


def _pad_columns_major(b: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    if tuple(b.shape) == (rows, cols):
        return b
    if b.t().is_contiguous():  # keep a column-major operand column-major (cuBLASLt's preferred B)
        return F.pad(b.t(), (0, rows - b.shape[0], 0, cols - b.shape[1])).t()
    return F.pad(b, (0, cols - b.shape[1], 0, rows - b.shape[0]))


def pad_for_int_mm(a: torch.Tensor, b: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor, int, int]:
    """Zero-pad int8 ``a`` (M, K) and ``b`` (K', N) for ``torch._int_mm``; ``b`` may be pre-padded (K' >= K).

    Returns ``(a_p, b_p, m, n)``: ``torch._int_mm(a_p, b_p)[:m, :n]`` is ``a @ b``. Operands
    already of a valid shape come back as they are (no copy).
    """
    m, k = a.shape
    k_b, n = b.shape
    if k > k_b:
        raise ValueError(f"pad_for_int_mm: a has {k} columns but b only {k_b} rows")
    pm, pk, pn = int_mm_padding(m, k_b, n)
    a_p = a if (pm, pk) == (m, k) else F.pad(a, (0, pk - k, 0, pm - m))
    return a_p, _pad_columns_major(b, pk, pn), m, n


def split_for_int16_pairs(b: torch.Tensor) -> Optional[torch.Tensor]:
    """``(hi, lo)`` stacked, with ``hi + lo == b`` and both within ``[-64, 64]``, where ``_int_mm`` on
    this CPU would saturate on ``b`` (a CPU without VNNI and a wider ``b``); None where it is exact.
    The Target decides (:attr:`~lucid_fx.kernels.target.Target.split_int_mm`); the real CPU is
    checked too, so a forced richer CPU never gets an unsplit weight it would saturate on."""
    if b.device.type != "cpu" or b.numel() == 0:
        return None
    if not resolve_target("cpu").split_int_mm and detected_cpu_features().vnni:
        return None
    if int(b.min()) >= -PAIR_SAFE and int(b.max()) <= PAIR_SAFE:
        return None
    hi = torch.div(b, 2, rounding_mode="floor")  # [-64, 63]; b - hi is then within [-64, 64]
    return torch.stack([hi, b - hi])


def _int_mm(a: torch.Tensor, b: torch.Tensor, halves: Optional[torch.Tensor]) -> torch.Tensor:
    if a.shape[1] == 1 and a.device.type == "cpu":
        # torch._int_mm on CPU (2.13) returns garbage for K == 1 and N > 1 (measured, either layout of b):
        # the one product per output is an outer product, exact in int32.
        return a.to(torch.int32) * b.to(torch.int32)
    if halves is None:
        return torch._int_mm(a, b)
    return torch._int_mm(a, halves[0]).add_(torch._int_mm(a, halves[1]))


def int_mm_padded(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` in int32 for int8 matrices of any shape, through padded ``torch._int_mm`` (exact on every CPU)."""
    a_p, b_p, m, n = pad_for_int_mm(a, b)
    halves = split_for_int16_pairs(b_p)
    return _int_mm(a_p, b_p, None if halves is None else _column_major(halves))[:m, :n]


def _column_major(halves: torch.Tensor) -> torch.Tensor:
    return halves.transpose(1, 2).contiguous().transpose(1, 2)  # keep each (K, N) half column-major


@dataclass(frozen=True)
class _GemmWeight:
    b: torch.Tensor  # (K', N') int8, column-major, zero-padded when pad
    row_sums: torch.Tensor  # (N,) int32
    n: int
    halves: Optional[torch.Tensor] = None  # b split for a CPU without VNNI (split_for_int16_pairs)


def _gemm_weight(w2d: torch.Tensor, pad: bool) -> _GemmWeight:
    n, k = w2d.shape
    src = w2d.contiguous()
    # The (K, N) column-major view shares the weight's storage but not its tensor: a view would
    # keep the weight alive through the cache entry it is the key of, and the entry would leak.
    b = src.new_empty(0).set_(src.untyped_storage(), src.storage_offset(), (k, n), (1, k))
    if pad:
        _, pk, pn = int_mm_padding(17, k, n)
        b = _pad_columns_major(b, pk, pn)
    halves = split_for_int16_pairs(b)
    return _GemmWeight(b, w2d.sum(1, dtype=torch.int32), n, None if halves is None else _column_major(halves))


def as_int8(q: torch.Tensor, zp: int) -> Tuple[torch.Tensor, int]:
    """int8 codes with the zero-point correction ``offset - zp`` of the shift into int8."""
    if q.dtype == torch.uint8:
        return (q ^ 128).view(torch.int8), 128 - zp
    if q.dtype == torch.int8:
        return q, -zp
    raise ValueError(f"int8 kernels read uint8 or int8 codes, got {q.dtype}")


def linear_weight(qw: torch.Tensor, pad: bool) -> _GemmWeight:
    """A linear's int8 weight in GEMM form (column-major, zero-padded when ``pad``) with its row sums,
    built once per weight."""
    return PREPARED.get(qw, ("linear", pad), lambda: _gemm_weight(qw, pad))


def raw_gemm(a: torch.Tensor, weight: _GemmWeight, pad: bool) -> torch.Tensor:
    """``a @ weight`` in int32 (M, N), maybe a view of a padded result."""
    acc = int_mm_padded(a, weight.b) if pad else _int_mm(a, weight.b, weight.halves)
    return acc[:, : weight.n] if acc.shape[1] != weight.n else acc


def _gemm(a: torch.Tensor, correction: int, weight: _GemmWeight, pad: bool) -> torch.Tensor:
    return raw_gemm(a, weight, pad) + correction * weight.row_sums


def _rescale(acc: torch.Tensor, x_scale: float, w_scale: torch.Tensor, bias: Optional[torch.Tensor]) -> torch.Tensor:
    y = acc.to(torch.float32).mul_(torch.tensor(x_scale, dtype=torch.float32) * w_scale.to(acc.device, torch.float32))
    return y if bias is None else y.add_(bias.to(torch.float32))


def int8_linear(
    qx: torch.Tensor, x_scale: float, x_zp: int, qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
    out_scale: float, out_zp: int, post_op: str, out_dtype: Optional[torch.dtype], pad: bool,
) -> torch.Tensor:
    """``lucid_fx::linear`` through ``torch._int_mm``; ``pad`` for CUDA's shape limits."""
    ref.check_post_op(post_op)
    weight = linear_weight(qw, pad)
    a, correction = as_int8(qx.reshape(-1, qx.shape[-1]), x_zp)
    y = _rescale(_gemm(a.contiguous(), correction, weight, pad), x_scale, w_scale, bias)
    y = y.reshape(*qx.shape[:-1], weight.n)
    return ref.finish(y, post_op, out_scale, out_zp, ref.out_storage(qx, out_dtype))


def _im2col_nhwc(x: torch.Tensor, fill: int, kernel, stride, padding, dilation) -> Tuple[torch.Tensor, List[int]]:
    """Rows of ``kh * kw * C`` input values, one per output pixel, in (N, Ho, Wo) order."""
    x = x.permute(0, 2, 3, 1)  # NHWC view
    ph, pw = padding
    if ph or pw:
        x = F.pad(x, (0, 0, pw, pw, ph, ph), value=fill)  # padding is real 0, that is, code zx
    x = x.contiguous()
    n, h, w, c = x.shape
    (kh, kw), (sh, sw), (dh, dw) = kernel, stride, dilation
    ho, wo = (h - dh * (kh - 1) - 1) // sh + 1, (w - dw * (kw - 1) - 1) // sw + 1
    sn, sh_, sw_, sc = x.stride()
    cols = x.as_strided((n, ho, wo, kh, kw, c), (sn, sh_ * sh, sw_ * sw, sh_ * dh, sw_ * dw, sc))
    return cols.reshape(n * ho * wo, kh * kw * c), [n, ho, wo]


def int8_conv(
    qx: torch.Tensor, x_scale: float, x_zp: int, qw: torch.Tensor, w_scale: torch.Tensor, bias: Optional[torch.Tensor],
    stride: List[int], padding: List[int], dilation: List[int], groups: int, out_scale: float, out_zp: int,
    post_op: str, out_dtype: Optional[torch.dtype], pad: bool,
) -> torch.Tensor:
    """``lucid_fx::conv1d`` / ``conv2d``: im2col + ``_int_mm`` (groups 1) or float conv on integer values."""
    ref.check_post_op(post_op)
    y = conv_float_out(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, pad)
    out = ref.finish(y, post_op, out_scale, out_zp, ref.out_storage(qx, out_dtype))
    return ref.to_layout(out, ref.conv2d_memory_format(qx) if qx.dim() == 4 else torch.contiguous_format)


def conv_float_out(qx, x_scale, x_zp, qw, w_scale, bias, stride, padding, dilation, groups, pad) -> torch.Tensor:
    """The float32 convolution result (before post-op and requantization); conv1d runs as height 1."""
    one_d = qx.dim() == 3
    if one_d:
        qx, stride, padding, dilation = qx.unsqueeze(2), [1, *stride], [0, *padding], [1, *dilation]
    kernel = (1, qw.shape[2]) if one_d else qw.shape[2:]
    if groups == 1:
        acc, correction, weight, (n, ho, wo) = conv_gemm(qx, x_zp, qw, kernel, stride, padding, dilation, pad)
        y = _rescale(acc + correction * weight.row_sums, x_scale, w_scale, bias)
        y = y.reshape(n, ho, wo, weight.n).permute(0, 3, 1, 2)
    else:
        w = qw.to(torch.float32)
        y = F.conv2d(qx.to(torch.float32).sub_(x_zp), w.unsqueeze(2) if one_d else w, None, stride, padding,
                     dilation, groups)
        scale = torch.tensor(x_scale, dtype=torch.float32) * w_scale.to(qx.device, torch.float32)
        y = y.mul_(scale.view(-1, 1, 1))
        y = y if bias is None else y.add_(bias.to(torch.float32).view(-1, 1, 1))
    return y.squeeze(2) if one_d else y


def conv_gemm(qx, x_zp, qw, kernel, stride, padding, dilation, pad) -> tuple:
    """A groups-1 convolution's GEMM on 4-d ``qx``: int32 sums with one row per output pixel in (N, Ho, Wo)
    order (maybe a view of a padded result), the zero-point correction, the weight, and ``(n, ho, wo)``."""
    if cuda_fused.available(qx, "operand"):  # one pass, padded for _int_mm; its extra rows are dropped below
        cols, correction, shape = cuda_fused.gemm_operand(qx, x_zp, kernel, stride, padding, dilation, pad)
    else:
        a, correction = as_int8(qx, x_zp)
        fill = x_zp - 128 if qx.dtype == torch.uint8 else x_zp
        cols, shape = _im2col_nhwc(a, fill, kernel, stride, padding, dilation)
    # Keyed by the caller's weight tensor (not a view of it), so the entry lives as long as it.
    weight = PREPARED.get(
        qw, ("conv_nhwc", pad), lambda: _gemm_weight(qw.movedim(1, -1).reshape(qw.shape[0], -1), pad)
    )
    return raw_gemm(cols, weight, pad)[: shape[0] * shape[1] * shape[2]], correction, weight, shape
