"""Grids in tests: whether this machine's oneDNN is exact on a Target's weight grid, and random codes
over a whole 8-bit grid."""

import torch

from lucid_fx.kernels.cpu_features import detected_cpu_features
from lucid_fx.kernels.target import NARROW_GRID, Target


def random_codes(shape, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Codes of ``dtype`` drawn over its whole range, the same for the same seed."""
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max + 1, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def onednn_exact(target: Target) -> bool:
    """Whether this machine's oneDNN computes products on ``target``'s weight grid exactly: always on
    a VNNI CPU; without VNNI, only on the narrow grid (``cpu._exact_on_onednn``, per weight). A VNNI
    kind forced on an AVX2 machine quantizes to the full grid, and its linears and convolutions take
    the exact fallback kernels, not oneDNN."""
    low, high = target.weight_range
    return detected_cpu_features().vnni or (low >= NARROW_GRID[0] and high <= NARROW_GRID[1])
