"""quantize / dequantize / fake_quantize on plain integer tensors.

Codes are ``clamp(round(x / scale) + zero_point, qmin, qmax)`` stored in the grid's
storage dtype (``int8``/``uint8``/``int32``); no quantized tensor dtypes are involved.
"""

from __future__ import annotations

from typing import Optional, Union

import torch

from lucid_fx.quantization.dtypes import QDtype, to_qdtype

__all__ = ["quantize", "dequantize", "fake_quantize"]

TensorLike = Union[torch.Tensor, float, int]


def _broadcast(param: TensorLike, x: torch.Tensor, ch_axis: Optional[int], dtype: torch.dtype) -> torch.Tensor:
    """Shape a per-tensor or per-channel parameter so it broadcasts against ``x``."""
    t = torch.as_tensor(param, dtype=dtype, device=x.device)
    if ch_axis is None or t.dim() == 0:
        if t.numel() != 1:
            raise ValueError(f"per-tensor qparams must hold one value, got shape {tuple(t.shape)}; pass ch_axis")
        return t.reshape(())
    axis = ch_axis % x.dim()
    if t.numel() != x.shape[axis]:
        raise ValueError(
            f"per-channel qparams have {t.numel()} values but axis {ch_axis} of the input has {x.shape[axis]}"
        )
    shape = [1] * x.dim()
    shape[axis] = -1
    return t.reshape(shape)


def _codes(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor) -> torch.Tensor:
    # Same arithmetic as torch's fake-quant kernels (multiply by the reciprocal), so codes agree
    # with the reference framework to the bit, ties included.
    return torch.round(x.float() * (1.0 / scale)) + zero_point


def quantize(
    x: torch.Tensor,
    scale: TensorLike,
    zero_point: TensorLike,
    qdtype: Union[QDtype, str, torch.dtype] = "quint8",
    ch_axis: Optional[int] = None,
) -> torch.Tensor:
    """Integer codes of ``x`` on the grid of ``qdtype``.

    >>> quantize(torch.tensor([100.0]), 0.05, 0, "qint8")
    tensor([127], dtype=torch.int8)
    """
    qdtype = to_qdtype(qdtype)
    s = _broadcast(scale, x, ch_axis, torch.float32)
    z = _broadcast(zero_point, x, ch_axis, torch.float32)
    q = torch.clamp(_codes(x, s, z), qdtype.quant_min, qdtype.quant_max)
    return q.to(qdtype.storage)


def dequantize(
    q: torch.Tensor, scale: TensorLike, zero_point: TensorLike, ch_axis: Optional[int] = None
) -> torch.Tensor:
    """Float32 values ``(q - zero_point) * scale`` of integer codes.

    >>> dequantize(torch.tensor([127], dtype=torch.int8), 0.05, 0)
    tensor([6.3500])
    """
    s = _broadcast(scale, q, ch_axis, torch.float32)
    z = _broadcast(zero_point, q, ch_axis, torch.int32)
    return (q.to(torch.int32) - z).to(torch.float32) * s


class _FakeQuantizeSTE(torch.autograd.Function):
    """Quantize-dequantize in float; the gradient passes straight through inside the grid."""

    @staticmethod
    def forward(ctx, x, scale, zero_point, quant_min, quant_max):
        codes = _codes(x, scale, zero_point)
        inside = (codes >= quant_min) & (codes <= quant_max)
        ctx.save_for_backward(inside)
        out = (torch.clamp(codes, quant_min, quant_max) - zero_point) * scale
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        (inside,) = ctx.saved_tensors
        return grad_out * inside, None, None, None, None


def fake_quantize(
    x: torch.Tensor,
    scale: TensorLike,
    zero_point: TensorLike,
    quant_min: int,
    quant_max: int,
    ch_axis: Optional[int] = None,
) -> torch.Tensor:
    """Quantize then dequantize ``x`` in float, with a straight-through gradient.

    The gradient is 1 where the unclamped code lies in ``[quant_min, quant_max]`` and 0 elsewhere.

    >>> x = torch.tensor([0.5, 99.0], requires_grad=True)
    >>> fake_quantize(x, 0.1, 0, 0, 255).sum().backward()
    >>> x.grad
    tensor([1., 0.])
    """
    if quant_min >= quant_max:
        raise ValueError(f"quant_min ({quant_min}) must be below quant_max ({quant_max})")
    s = _broadcast(scale, x, ch_axis, torch.float32)
    z = _broadcast(zero_point, x, ch_axis, torch.float32)
    return _FakeQuantizeSTE.apply(x, s, z, quant_min, quant_max)
