import sys
from pathlib import Path

import pytest
import torch

# The benchmark models double as end-to-end test models.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))


def sqnr(reference: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB."""
    reference, test = reference.detach().float(), test.detach().float()
    noise = (reference - test).pow(2).mean()
    return float(10 * torch.log10(reference.pow(2).mean() / noise.clamp_min(1e-20)))


@pytest.fixture
def sqnr_db():
    return sqnr

