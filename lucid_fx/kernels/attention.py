"""The masked softmax of attention: int8 scores, a float mask, int8 probabilities.

``lucid_fx::masked_softmax`` is ``softmax(s.masked_fill(mask, fill))`` (``fill`` given, ``mask``
bool) or ``softmax(s + mask)`` (``fill`` None, ``mask`` an additive float mask or bias), where
``s`` is the dequantized scores. The mask is applied in float32 exactly as the float model
applies it, so a position is masked exactly when it is in float: ``-inf``, ``-1e9``,
``finfo.min`` or ``-1e4`` all give probability exactly 0 (``exp`` underflows to 0 in float32
below about -104, and any probability under half a step of the output grid is code 0), and
any other value is an exact additive bias. No threshold is involved.

A row masked everywhere with ``-inf`` is NaN in float; int8 codes hold no NaN, so it comes out
as all zeros (code ``out_zp``), which is also what fused attention kernels give. A row masked
everywhere with one finite value is uniform, as in float.

>>> s = torch.ops.lucid_fx.quantize_per_tensor(torch.tensor([[1.0, 2.0, 3.0]]), 0.05, 128, 0, 255, torch.uint8)
>>> p = torch.ops.lucid_fx.masked_softmax(s, 0.05, 128, torch.tensor([[False, False, True]]), float("-inf"), -1, 1 / 256, 0)
>>> p, (p.float() / 256).sum().item()
(tensor([[ 69, 187,   0]], dtype=torch.uint8), 1.0)
"""

from typing import Optional

import torch

from lucid_fx.kernels.reference import dequant, finish

__all__ = ["masked_softmax", "fake_masked_softmax", "apply_mask", "as_bias", "check_mask"]


def check_mask(mask: torch.Tensor, fill: Optional[float]) -> None:
    """Raise ValueError for a mask the op cannot apply: ``masked_fill`` needs a bool mask."""
    if fill is not None and mask.dtype != torch.bool:
        raise ValueError(f"masked_softmax: a mask with a fill value must be torch.bool (masked_fill), got {mask.dtype}")


def as_bias(mask: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A bool mask filling -inf as the bias it is: 0 where kept, -inf where masked (``x + -inf`` is -inf
    and ``x + 0`` is ``x``: the values ``masked_fill`` gives)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, float("-inf"))


def apply_mask(x: torch.Tensor, mask: torch.Tensor, fill: Optional[float]) -> torch.Tensor:
    """``x.masked_fill(mask, fill)`` or ``x + mask`` in float32, in place where the shapes allow
    (``x`` is a temporary of the caller)."""
    if fill == float("-inf") and mask.numel() < x.numel():
        # adding a broadcast bias is faster than masked_fill_ (8x4x128x128 scores, a padding mask: 0.10
        # against 0.47 ms, one thread)
        mask, fill = as_bias(mask, x.dtype), None
    # mask broadcasts to x's shape (torch.broadcast_shapes says the same in 24 us, this in 1)
    in_place = mask.dim() <= x.dim() and all(m in (1, n) for m, n in zip(reversed(mask.shape), reversed(x.shape)))
    if fill is not None:
        return x.masked_fill_(mask, fill) if in_place else x.masked_fill(mask, fill)
    return x.add_(mask) if in_place else x + mask


def masked_softmax(
    q: torch.Tensor, scale: float, zp: int, mask: torch.Tensor, fill: Optional[float], dim: int,
    out_scale: float, out_zp: int,
) -> torch.Tensor:
    """Softmax along ``dim`` of the dequantized scores, masked in float32 (see the module), quantized
    with ``(out_scale, out_zp)``; the result has the broadcast shape of ``q`` and ``mask``."""
    check_mask(mask, fill)
    y = torch.softmax(apply_mask(dequant(q, scale, zp), mask, fill), dim)
    return finish(y.nan_to_num_(nan=0.0), "none", out_scale, out_zp, q.dtype)


def fake_masked_softmax(q, scale, zp, mask, fill, dim, out_scale, out_zp):
    # torch.softmax returns a contiguous tensor whatever the layout of its input
    return torch.empty(torch.broadcast_shapes(q.shape, mask.shape), dtype=q.dtype, device=q.device)
