"""Normalisations on int8 codes: layer norm, RMS norm and group norm, codes in and codes out, the
statistics computed in float inside the kernel (dequantize -> normalise with weight and bias -> quantize).

A norm's output is not bounded by its input's grid: the statistics are those of the whole row, so
the output gets its own calibrated grid (``out_scale``, ``out_zp``). The CPU kernels skip the
dequantize: layer norm ignores a shift, so the zero point is never subtracted, and scaling the
input by ``s`` is the same as dividing ``eps`` by ``s**2``. Layer and RMS norm read their input
contiguous (rows of the normalised dims next to each other) and return contiguous codes; group norm
keeps its input's layout (a convolution's channels-last codes stay channels-last).

>>> x = torch.randn(2, 8)
>>> q = torch.ops.lucid_fx.quantize_per_tensor(x, 0.03, 128, 0, 255, torch.uint8)
>>> y = torch.ops.lucid_fx.layer_norm(q, 0.03, 128, [8], None, None, 1e-5, 0.02, 128)
>>> ref = torch.nn.functional.layer_norm(torch.ops.lucid_fx.dequantize_per_tensor(q, 0.03, 128), [8])
>>> bool(((torch.ops.lucid_fx.dequantize_per_tensor(y, 0.02, 128) - ref).abs() <= 0.01 + 1e-6).all())
True
"""

import math
from typing import List, Optional

import torch
import torch.nn.functional as F

from lucid_fx.kernels import native
from lucid_fx.kernels.codes import conv2d_memory_format, dequant, f32_reciprocal, finish, to_layout
from lucid_fx.kernels.reference import lut

__all__ = ["layer_norm", "rms_norm", "group_norm", "fake_norm", "fake_group_norm", "cpu_layer_norm", "cpu_rms_norm",
           "cpu_group_norm"]


def layer_norm(
    q: torch.Tensor, scale: float, zp: int, normalized_shape: List[int], weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], eps: float, out_scale: float, out_zp: int,
) -> torch.Tensor:
    """``F.layer_norm`` of per-tensor codes, quantized with ``(out_scale, out_zp)``."""
    y = F.layer_norm(dequant(q.contiguous(), scale, zp), normalized_shape, weight, bias, eps)
    return finish(y, "none", out_scale, out_zp, q.dtype)


def rms_norm(
    q: torch.Tensor, scale: float, zp: int, normalized_shape: List[int], weight: Optional[torch.Tensor],
    eps: float, out_scale: float, out_zp: int,
) -> torch.Tensor:
    """``F.rms_norm`` of per-tensor codes, quantized with ``(out_scale, out_zp)``."""
    y = F.rms_norm(dequant(q.contiguous(), scale, zp), normalized_shape, weight, eps)
    return finish(y, "none", out_scale, out_zp, q.dtype)


def group_norm(
    q: torch.Tensor, scale: float, zp: int, num_groups: int, weight: Optional[torch.Tensor],
    bias: Optional[torch.Tensor], eps: float, out_scale: float, out_zp: int,
) -> torch.Tensor:
    """``F.group_norm`` of per-tensor codes, quantized with ``(out_scale, out_zp)``, in ``q``'s layout."""
    y = F.group_norm(dequant(q, scale, zp), num_groups, weight, bias, eps)
    return to_layout(finish(y, "none", out_scale, out_zp, q.dtype), _layout(q))


def _layout(q: torch.Tensor) -> torch.memory_format:
    return conv2d_memory_format(q) if q.dim() == 4 else torch.contiguous_format


def fake_norm(q: torch.Tensor, *rest) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


def fake_group_norm(q: torch.Tensor, *rest) -> torch.Tensor:
    return torch.empty(q.shape, dtype=q.dtype, device=q.device, memory_format=_layout(q))


def _native_norm(q, zp, normalized_shape, weight, bias, eps, out_scale, out_zp, rms: bool) -> Optional[torch.Tensor]:
    """native_norm.c's one pass per row (exact sums of the codes, float32 steps), or None where the
    kernels are not loaded or a weight or bias is not a dense float32 tensor of the normalised size."""
    fn = native._function("norm", q.dtype)
    n = math.prod(normalized_shape)
    params = [t for t in (weight, bias) if t is not None]
    if fn is None or not 0 < n < 1 << 15 or q.numel() % n or q.device.type != "cpu" or not all(  # int32 sums
            t.dtype == torch.float32 and t.is_contiguous() and t.numel() == n and t.device.type == "cpu" for t in params):
        return None
    q, info = q.contiguous(), torch.iinfo(q.dtype)
    out = torch.empty_like(q)
    fn(q.data_ptr(), out.data_ptr(), q.numel() // n, n, zp if rms else 0, int(rms), eps,
       None if weight is None else weight.data_ptr(), None if bias is None else bias.data_ptr(),
       f32_reciprocal(out_scale), out_zp, info.min, info.max)
    return out


def cpu_layer_norm(q, scale, zp, normalized_shape, weight, bias, eps, out_scale, out_zp):
    """Layer norm of the raw codes: no zero point (a shift), no scale (folded into ``eps``); one
    native pass where the kernels are loaded (values within float32 rounding of torch's)."""
    eps = eps / (scale * scale)
    out = _native_norm(q, zp, normalized_shape, weight, bias, eps, out_scale, out_zp, rms=False)
    if out is not None:
        return out
    y = F.layer_norm(q.contiguous().to(torch.float32), normalized_shape, weight, bias, eps)
    return finish(y, "none", out_scale, out_zp, q.dtype)


def cpu_rms_norm(q, scale, zp, normalized_shape, weight, eps, out_scale, out_zp):
    """RMS norm of the centred codes: the scale folds into ``eps``, the zero point does not; one
    native pass where the kernels are loaded."""
    eps = eps / (scale * scale)
    out = _native_norm(q, zp, normalized_shape, weight, None, eps, out_scale, out_zp, rms=True)
    if out is not None:
        return out
    codes = q.contiguous().to(torch.float32)
    y = F.rms_norm(codes.sub_(zp) if zp else codes, normalized_shape, weight, eps)
    return finish(y, "none", out_scale, out_zp, q.dtype)


def _native_group_norm(q, num_groups, weight, bias, eps, out_scale, out_zp, tail) -> Optional[torch.Tensor]:
    """native_norm.c's group norm (exact sums per channel, one affine step a code, the tail's lookup), or None
    where the kernels are not loaded or the codes, weight, bias or tail are not laid out as it reads them."""
    fn = native._function("group_norm", q.dtype if tail is None else tail.dtype)
    c = q.shape[1] if q.dim() >= 2 else 0
    channels_last = q.dim() == 4 and not q.is_contiguous() and q.is_contiguous(memory_format=torch.channels_last)
    params = [t for t in (weight, bias) if t is not None]
    if fn is None or q.numel() == 0 or c % num_groups or q.device.type != "cpu" or not (q.is_contiguous() or channels_last) \
            or not all(t.dtype == torch.float32 and t.is_contiguous() and t.numel() == c and t.device.type == "cpu"
                       for t in params) or (tail is not None and (tail.numel() != 256 or not tail.is_contiguous())):
        return None
    info = torch.iinfo(q.dtype)
    out = torch.empty_like(q, dtype=q.dtype if tail is None else tail.dtype)
    failed = fn(q.data_ptr(), out.data_ptr(), q.shape[0], c, q[0, 0].numel(), num_groups, int(channels_last),
                int(q.dtype == torch.int8), eps, None if weight is None else weight.data_ptr(),
                None if bias is None else bias.data_ptr(), f32_reciprocal(out_scale), out_zp, info.min, info.max,
                None if tail is None else tail.data_ptr())
    return None if failed else out


def cpu_group_norm(q, scale, zp, num_groups, weight, bias, eps, out_scale, out_zp, tail: Optional[torch.Tensor] = None):
    """Group norm of the raw codes (no zero point, the scale folded into ``eps``, as layer norm), in
    ``q``'s layout; ``tail`` is a following 256-entry table lookup (the program composes a SiLU's or a
    dequantize's into it). One native pass for the sums and one for the codes (and one for a tail) where
    the kernels are loaded (values within float32 rounding of torch's)."""
    eps = eps / (scale * scale)
    out = _native_group_norm(q, num_groups, weight, bias, eps, out_scale, out_zp, tail)
    if out is not None:
        return out
    y = F.group_norm(q.to(torch.float32), num_groups, weight, bias, eps)
    codes = to_layout(finish(y, "none", out_scale, out_zp, q.dtype), _layout(q))
    return codes if tail is None else lut(codes, tail)
