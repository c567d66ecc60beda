"""oneDNN's int8 convolution checked once per packed weight and input shape, on the CPUs where it was found wrong.

On an Intel Xeon with AMX (torch 2.13.0, its oneDNN), ``onednn.qconv1d_pointwise`` and ``qconv2d_pointwise`` return
wrong codes (up to all 255 steps off) for some convolutions whose groups hold fewer than 32 input channels, a
multiple of 4, with a wide kernel: 16 channels by a kernel 8 or 16 wide, 8 by 16, 4 by 32, and others without a
pattern (16 by 6 fails where 24 by 8 does not), whatever the batch, from about 12 output positions on. The same
calls are exact with oneDNN capped below AMX (``ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI``), and on the AVX2 and
AVX512-VNNI CPUs measured. wav2vec 2.0's positional convolution (64 channels in 4 groups, kernel 16) took its
model's output from 30 dB to 5.7.

So where oneDNN runs its AMX kernels (:func:`checked_here`), each pack is run once on codes whose exact result a
float convolution gives, and a pack that disagrees is not used: that convolution runs on lucid_fx's exact
``_int_mm`` path instead (:func:`lucid_fx.kernels.int_mm.int8_conv`). One call and one float convolution per
weight and input shape, at its first call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from lucid_fx.kernels.codes import onednn_post_op
from lucid_fx.kernels.cpu_features import detected_cpu_features

__all__ = ["checked_here", "conv_agrees", "PROBE_CODES"]

#: The probe's activation codes lie in [0, PROBE_CODES): with weights of at most 128 in magnitude, sums of up to
#: 2^24 / (15 * 128) = 8738 products stay exact in float32 (the reference's sums past that are float64).
PROBE_CODES = 16


@functools.lru_cache(maxsize=None)
def checked_here() -> bool:
    """Whether this machine's oneDNN runs its AMX kernels, where its convolutions are checked (tests force it)."""
    return detected_cpu_features().amx


def conv_agrees(packed: torch.Tensor, qw: torch.Tensor, w_scale: torch.Tensor, x_shape, stride, padding, dilation,
                groups: int) -> bool:
    """Whether oneDNN's convolution on ``packed`` (``qw`` packed for inputs of ``x_shape``) gives the exact result on
    this machine: True where :func:`checked_here` is False; else one run of it on probe codes, against a float
    convolution of the same codes (a relative 1e-5: float32's rounding of the scale, not a wrong sum)."""
    if not checked_here():
        return True
    x = torch.randint(0, PROBE_CODES, tuple(x_shape), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    two_d = x.dim() == 4
    if two_d:
        x = x.contiguous(memory_format=torch.channels_last)
    ws = w_scale.to(torch.float32)
    try:
        got = _onednn_conv(x, packed, ws, list(stride), list(padding), list(dilation), groups)
    except RuntimeError:
        return False
    exact = (PROBE_CODES - 1) * 128 * qw[0].numel() < 2 ** 24
    dtype = torch.float32 if exact else torch.float64
    conv = F.conv2d if two_d else F.conv1d
    want = conv(x.to(dtype), qw.to(dtype), None, list(stride), list(padding), list(dilation), groups)
    want = want * ws.to(dtype).view(-1, *([1] * (want.dim() - 2)))
    if got.shape != want.shape:
        return False
    scale = float(want.abs().max()) if want.numel() else 0.0
    return bool((got.to(dtype) - want).abs().max() <= 1e-5 * scale + 1e-6) if want.numel() else True


def _onednn_conv(x: torch.Tensor, packed: torch.Tensor, w_scale: torch.Tensor, stride, padding, dilation,
                 groups: int) -> torch.Tensor:
    """oneDNN's float32 convolution of uint8 codes ``x`` (scale 1, zero point 0) on ``packed``, no bias."""
    kernel = torch.ops.onednn.qconv2d_pointwise.default if x.dim() == 4 else torch.ops.onednn.qconv1d_pointwise.default
    zeros = torch.zeros(w_scale.shape[0], dtype=torch.int64)
    return kernel(x, 1.0, 0, packed, w_scale, zeros, None, stride, padding, dilation, groups, 1.0, 0, torch.float32,
                  *onednn_post_op("none"))
