"""Zero-point folding for the oneDNN CPU kernels: ``bias - x_scale * w_scale * x_zp * sum(qw[o])``
lets oneDNN run with an activation zero point of 0 (10-45% faster, measured; see
:func:`_zero_point_in_bias`), wherever every output sums the whole weight window and the raw
accumulator is exact in float32. Whether to fold at all is the Target's choice
(:attr:`~lucid_fx.kernels.target.Target.fold_zero_point`)."""

from typing import Optional, Tuple

import torch

from lucid_fx.kernels.library import WeightCache, _version_of
from lucid_fx.kernels.target import resolve_target

__all__ = ["FOLDED_BIASES", "FOLDED_GRIDS", "signed_zero_point_bias", "to_signed"]

# Biases with the activation zero point folded in (and each weight's sums), per weight and input grid.
FOLDED_BIASES = WeightCache()
FOLDED_GRIDS = 4


def _weight_sums(qw: torch.Tensor, code_max: int = 255) -> Optional[torch.Tensor]:
    """Per-output sums of ``qw`` (float64), once per weight; None when folding could round: the raw
    accumulator (activation codes up to ``code_max`` in magnitude against the weight) must stay exact in float32."""
    def build():
        flat = qw.reshape(qw.shape[0], -1)
        if code_max * int(flat.to(torch.int32).abs().sum(1, dtype=torch.int64).max()) >= 2**24:  # int8 -128.abs() is -128
            return None
        return flat.sum(1, dtype=torch.int64).double()

    return FOLDED_BIASES.get(qw, "weight sums" if code_max == 255 else ("weight sums", code_max), build)


def _zero_point_exact_on_onednn(qw: torch.Tensor, x_zp: int) -> bool:
    """Whether oneDNN's linear subtracts a zero point left to it exactly. On an AMX CPU (Xeon with
    AVX512-VNNI and AMX, torch 2.13) its compensation was measured 2 codes off on 164 of 256
    outputs once the raw accumulator passed 2^24, where float32 stops being exact; such a linear
    (a wide layer with an asymmetric input) goes in as int8 codes where that is exact
    (:func:`signed_zero_point_bias`), else runs on the exact ``_int_mm`` path there."""
    return x_zp == 0 or not resolve_target("cpu").amx_zero_point_check or _weight_sums(qw) is not None


def signed_zero_point_bias(qw, w_scale, bias, x_scale: float, zp_u8: int) -> Optional[torch.Tensor]:
    """The bias for uint8 codes with zero point ``zp_u8`` given to oneDNN as int8 codes (:func:`to_signed`: the code
    minus 128) with zero point 0: their zero point ``zp_u8 - 128`` folded in, where that is exact. Their raw
    accumulator is half the uint8 codes' (128 against 255 times the weight's sum of magnitudes), so a wide layer
    whose uint8 zero point neither folds exactly nor is left to oneDNN exactly (AMX:
    :func:`_zero_point_exact_on_onednn`) takes oneDNN's linear this way, at its speed (the
    batch-64 MLP's first Linear(1024): 65 us against 300 on the exact ``_int_mm`` path, AMX Xeon, 2 threads)."""
    return _zero_point_in_bias(qw, w_scale, bias, x_scale, zp_u8 - 128, code_max=128)


def to_signed(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes as int8 codes 128 lower (the same values with a zero point 128 lower): 7 us for 64 x 1024."""
    return torch.bitwise_xor(codes, 128).view(torch.int8)


def _zero_point_in_bias(qw, w_scale, bias, x_scale: float, x_zp: int, code_max: int = 255) -> Optional[torch.Tensor]:
    """``bias - x_scale * w_scale * x_zp * sum(qw[o])``, or None where folding could round.

    With it oneDNN runs with an activation zero point of 0, which measured 10-15% faster for a
    linear (Linear(1024): 201 vs 237 us at batch 1, 1.08 vs 1.19 ms at batch 64) and 10-45% for
    unpadded convolutions. Valid only where every output sums the whole weight window (linears,
    convolutions without padding: a padded tap reads no zero point), and only while the raw
    accumulator is exact in float32; codes then match the unfolded call except where float32
    rounding moves a tie. Kept for up to FOLDED_GRIDS input grids per weight (each entry holds the
    scale and bias tensors it was built from, and is rebuilt when either is replaced or changed);
    further grids, as dynamic quantization makes one per batch, are folded per call."""
    sums = _weight_sums(qw, code_max)
    if sums is None:
        return None
    key = ("zero point in bias", x_scale, x_zp) if code_max == 255 else ("zero point in bias", x_scale, x_zp, code_max)
    stamp = (w_scale, _version_of(w_scale), bias, None if bias is None else _version_of(bias))
    entry = FOLDED_BIASES.peek(qw, key)
    if entry is not None:
        (scale_then, scale_version, bias_then, bias_version), folded = entry
        if scale_then is w_scale and bias_then is bias and (scale_version, bias_version) == stamp[1::2]:
            return folded
    folded = -(x_scale * x_zp) * w_scale.double() * sums
    folded = (folded if bias is None else folded + bias.double()).to(torch.float32)
    if entry is not None or FOLDED_BIASES.count(qw, lambda k: k[0] == "zero point in bias") < FOLDED_GRIDS:
        FOLDED_BIASES.put(qw, key, (stamp, folded))
    return folded


def _float(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return t if t is None or t.dtype == torch.float32 else t.to(torch.float32)  # a no-op .to() costs ~2 us


def _folded_zero_point(qw, w_scale, bias, x_scale, x_zp) -> Tuple[int, Optional[torch.Tensor]]:
    """(zero point, bias) to give oneDNN: the zero point folded into the bias where that is exact."""
    folded = _zero_point_in_bias(qw, w_scale, bias, x_scale, x_zp) if x_zp and resolve_target("cpu").fold_zero_point else None
    return (0, folded) if folded is not None else (x_zp, _float(bias))


def _unpadded_zero_point(qw, w_scale, bias, x_scale, x_zp, padding) -> Tuple[int, Optional[torch.Tensor]]:
    """Convolutions fold the zero point only when nothing is padded."""
    return (x_zp, _float(bias)) if any(padding) else _folded_zero_point(qw, w_scale, bias, x_scale, x_zp)
