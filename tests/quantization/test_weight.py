"""quantize_weight: per-channel symmetric int8 codes on the kernel's weight grid."""

import pytest
import torch

from lucid_fx.quantization.weight import quantize_weight


@pytest.mark.parametrize("grid, half_span", [((-128, 127), 127.5), ((-64, 63), 63.5)])
def test_each_channel_is_scaled_by_its_own_largest_magnitude(grid, half_span):
    w = torch.tensor([[1.0, -2.0, 0.5], [0.1, 0.2, -0.3]])
    codes, scale = quantize_weight(w, None, grid)
    assert codes.dtype == torch.int8
    assert torch.allclose(scale, torch.tensor([2.0, 0.3]) / half_span)
    assert int(codes.min()) >= grid[0] and int(codes.max()) <= grid[1]
    assert (codes - w / scale[:, None]).abs().max() <= 0.5 + 1e-4  # the nearest code (ties either way)
    assert (codes * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-7


def test_a_per_tensor_observer_range_serves_every_channel():
    from lucid_fx.quantization.observers import MinMaxObserver

    w = torch.tensor([[1.0, -2.0], [0.1, 0.2]])
    _, scale = quantize_weight(w, MinMaxObserver(qscheme="per_tensor_symmetric", qdtype="qint8"), (-128, 127))
    assert torch.allclose(scale, torch.full((2,), 2.0 / 127.5))
