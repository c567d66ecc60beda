"""``lucid_fx::channel_lut``: one 256-entry table per channel, what a standalone batch norm on codes is (and a PReLU
with a slope per channel).

A batch norm in eval mode is ``y = x * a[c] + b[c]``, one affine map per channel: on 8-bit codes of
one input grid it is one table per channel from the input's codes to the output's
(:func:`batch_norm_tables`, built at convert; a following relu composes into the same tables).
DenseNet's ``cat -> batch_norm -> relu -> conv`` runs it (torch.ao's ``quantized::batch_norm2d_relu``
computes the same map in float per element).

>>> q = torch.tensor([[0, 1], [2, 3]], dtype=torch.uint8)  # (N=2, C=2)
>>> tables = torch.stack([torch.arange(256), 255 - torch.arange(256)]).to(torch.uint8)
>>> channel_lut(q, tables, 1)  # channel 0 keeps its codes, channel 1 mirrors them
tensor([[  0, 254],
        [  2, 252]], dtype=torch.uint8)
"""

from __future__ import annotations

import torch

from lucid_fx.kernels.codes import quant

__all__ = ["channel_lut", "fake_channel_lut", "channel_tables", "batch_norm_tables", "prelu_tables", "code_index"]


def code_index(q: torch.Tensor) -> torch.Tensor:
    """The 256-entry table index of each 8-bit code (int8 codes index from -128)."""
    if q.dtype == torch.int8:
        return q.view(torch.uint8) ^ 128  # code + 128: the sign bit flipped, read as uint8
    if q.dtype == torch.uint8:
        return q
    raise ValueError(f"channel_lut reads uint8 or int8 codes, got {q.dtype}")


def channel_lut(q: torch.Tensor, tables: torch.Tensor, dim: int) -> torch.Tensor:
    """``tables[c, code]`` for each code of channel ``c`` along ``dim``, in ``q``'s layout."""
    dim = dim % max(q.dim(), 1)
    if tables.dim() != 2 or tables.shape[1] != 256 or q.dim() <= dim or tables.shape[0] != q.shape[dim]:
        raise ValueError(f"channel_lut takes ({q.shape[dim] if q.dim() > dim else '?'}, 256) tables for dim {dim} "
                         f"of codes {tuple(q.shape)}, got {tuple(tables.shape)}")
    channel = [1] * q.dim()
    channel[dim] = -1
    offsets = 256 * torch.arange(tables.shape[0], device=q.device).view(channel)
    out = tables.to(q.device).flatten()[code_index(q).long() + offsets]
    like = torch.empty_like(q, dtype=out.dtype)
    return out if like.stride() == out.stride() else like.copy_(out)


def fake_channel_lut(q: torch.Tensor, tables: torch.Tensor, dim: int) -> torch.Tensor:
    torch._check(tables.dim() == 2 and tables.shape[1] == 256, lambda: f"channel_lut takes (C, 256) tables, got {tuple(tables.shape)}")
    return torch.empty_like(q, dtype=tables.dtype)


def channel_tables(fn, in_scale: float, in_zp: int, in_range, out_scale: float, out_zp: int, out_range,
                   dtype: torch.dtype) -> torch.Tensor:
    """(C, 256) tables of ``quantize(fn(dequantize(code)))`` where ``fn`` maps the 256 input values (float64) to
    a row per channel, computed once; entries for codes outside ``in_range`` repeat the nearest end, as
    :func:`~lucid_fx.kernels.reference.make_lut`'s do."""
    info = torch.iinfo(torch.uint8 if in_range[0] >= 0 else torch.int8)
    codes = torch.arange(info.min, info.max + 1, dtype=torch.float64).clamp(*in_range)
    return quant(fn((codes - in_zp) * float(in_scale)).float(), out_scale, out_zp, out_range[0], out_range[1], dtype)


def batch_norm_tables(mean, var, weight, bias, eps: float, in_scale: float, in_zp: int, in_range, out_scale: float,
                      out_zp: int, out_range, dtype: torch.dtype) -> torch.Tensor:
    """The :func:`channel_tables` of an eval batch norm (the map is exact to the output grid)."""
    c = mean.numel()
    w = torch.ones(c, dtype=torch.float64) if weight is None else weight.detach().double()
    b = torch.zeros(c, dtype=torch.float64) if bias is None else bias.detach().double()
    a = w / torch.sqrt(var.detach().double() + eps)
    shift = b - mean.detach().double() * a
    return channel_tables(lambda values: values[None, :] * a[:, None] + shift[:, None], in_scale, in_zp, in_range,
                          out_scale, out_zp, out_range, dtype)


def prelu_tables(weight: torch.Tensor, in_scale: float, in_zp: int, in_range, out_scale: float, out_zp: int, out_range,
                 dtype: torch.dtype) -> torch.Tensor:
    """The :func:`channel_tables` of ``F.prelu`` with a slope per channel."""
    slope = weight.detach().double().reshape(-1, 1)
    return channel_tables(lambda values: torch.where(values >= 0, values, slope * values), in_scale, in_zp, in_range,
                          out_scale, out_zp, out_range, dtype)
