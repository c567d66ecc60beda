"""quantize_weight: per-channel symmetric int8 codes on the kernel's weight grid."""

import pytest
import torch

from lucid_fx.quantization.weight import quantize_weight


@pytest.mark.parametrize("grid, half_span", [((-128, 127), 127.5), ((-64, 63), 63.5)])
def test_each_channel_is_scaled_by_its_own_largest_magnitude(grid, half_span):
    w = torch.tensor([[1.0, -2.0, 0.5], [0.1, 0.2, -0.3]])
    codes, scale = quantize_weight(w, None, grid, least_error=True)
    assert codes.dtype == torch.int8
    if grid == (-64, 63):  # the least rounding error (below): ~2 / 64 puts channel 0's three weights on codes
        assert abs(float(scale[0]) - 2.0 / 64) < 0.01 * 2.0 / 64 and codes[0].tolist() == [32, -64, 16]
        assert 0.8 * 0.3 / 63.5 <= scale[1] <= 0.3 / 63.5
    else:
        assert torch.allclose(scale, torch.tensor([2.0, 0.3]) / half_span)
    assert int(codes.min()) >= grid[0] and int(codes.max()) <= grid[1]
    assert (codes - w / scale[:, None]).abs().max() <= 0.5 + 1e-4  # the nearest code (ties either way)
    assert (codes * scale[:, None] - w).abs().max() <= scale.max() / 2 + 1e-7


def test_a_per_tensor_observer_range_serves_every_channel():
    from lucid_fx.quantization.observers import MinMaxObserver

    w = torch.tensor([[1.0, -2.0], [0.1, 0.2]])
    _, scale = quantize_weight(w, MinMaxObserver(qscheme="per_tensor_symmetric", qdtype="qint8"), (-128, 127))
    assert torch.allclose(scale, torch.full((2,), 2.0 / 127.5))


def test_on_the_narrow_grid_each_channel_takes_the_scale_with_the_least_rounding_error():
    """[-64, 63] (CPUs without VNNI): the fraction of the min/max scale in [0.8, 1] whose codes are nearest
    the weights: a Gaussian channel clips its few largest, a uniform one keeps min/max; the full grid keeps min/max."""
    w = torch.randn(3, 4096, generator=torch.Generator().manual_seed(0))
    w[1] = torch.linspace(-1.0, 1.0, 4096)
    plain = w.abs().amax(1) / 63.5

    def error(codes, scale):
        return ((codes.float() * scale[:, None] - w) ** 2).sum(1)

    codes, scale = quantize_weight(w, None, (-64, 63), least_error=True)
    plain_codes = torch.clamp(torch.round(w / plain[:, None]), -64, 63)
    fractions = scale / plain
    assert (fractions[[0, 2]] >= 0.8).all() and (fractions[[0, 2]] < 0.98).all(), fractions  # clipped (0.965, 0.945)
    assert fractions[1] == 1.0
    assert (error(codes, scale) <= error(plain_codes, plain)).all()
    assert (error(codes, scale)[[0, 2]] < 0.95 * error(plain_codes, plain)[[0, 2]]).all()
    assert (codes[[0, 2]] == -64).any() and (codes[[0, 2]] == 63).any()  # the clipped tails sit on the grid's ends
    _, full = quantize_weight(w, None, (-128, 127), least_error=True)
    assert torch.allclose(full, w.abs().amax(1) / 127.5)
    _, dynamic = quantize_weight(w, None, (-64, 63))  # quantize_dynamic's and the recurrent layers': min/max
    assert torch.equal(dynamic, plain)
    from lucid_fx.quantization.observers import MinMaxObserver

    per_tensor = MinMaxObserver(qscheme="per_tensor_symmetric", qdtype="qint8")  # one range, as the QConfig asks
    _, shared = quantize_weight(w, per_tensor, (-64, 63), least_error=True)
    assert shared.unique().numel() == 1
