"""lucid_fx::quantize_per_tensor at the float-to-int8 boundary: the reference codes bit for bit,
the clamp skipped only when no code leaves the grid, and NaN/±inf refused (not huge finite values)."""

import pytest
import torch

from lucid_fx.kernels import quantize
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.checks import KernelInputError

ops = torch.ops.lucid_fx


@pytest.mark.parametrize("spread", [0.5, 4.0, 1e6])  # inside the grid, partly outside, far outside
@pytest.mark.parametrize(
    "scale, zp, qmin, qmax, dtype",
    [(0.02, 128, 0, 255, torch.uint8), (0.02, 0, 0, 255, torch.uint8), (0.03, -5, -128, 127, torch.int8),
     (0.05, 3, 0, 127, torch.uint8)],
)
def test_codes_are_the_reference_codes(spread, scale, zp, qmin, qmax, dtype):
    x = torch.randn(64, 33, generator=torch.Generator().manual_seed(0)) * spread
    x[0, :4] = torch.tensor([0.5, -0.5, 1.5, -1.5]) * scale  # rounding ties
    expected = ref.quantize_per_tensor(x, scale, zp, qmin, qmax, dtype)
    assert torch.equal(ops.quantize_per_tensor(x, scale, zp, qmin, qmax, dtype), expected)
    assert torch.equal(ops.quantize_per_tensor(x.double(), scale, zp, qmin, qmax, dtype), expected)


def test_the_clamp_runs_only_when_a_code_leaves_the_grid():
    inside = torch.tensor([0.0, 1.0, 2.5])
    outside = torch.tensor([0.0, 1.0, 9.0])
    codes = lambda x: (x * 100).round_()  # noqa: E731  (scale 0.01, zero point 0)
    assert quantize.codes_need_clamp(codes(inside), 0, 255, inside) is False
    assert quantize.codes_need_clamp(codes(outside), 0, 255, outside) is True
    assert ops.quantize_per_tensor(outside, 0.01, 0, 0, 255, torch.uint8).tolist() == [0, 100, 255]


def test_huge_finite_values_are_clamped_not_refused():
    # 3e38 / 1e-3 overflows float32 to inf in the codes, though the value itself is finite.
    x = torch.tensor([3.0e38, -3.0e38, 0.001])
    assert ops.quantize_per_tensor(x, 1e-3, 10, 0, 255, torch.uint8).tolist() == [255, 0, 11]


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_values_are_refused_and_counted(bad):
    x = torch.zeros(3, 7)
    x[2, 6] = bad
    with pytest.raises(KernelInputError, match="it holds NaN or ±inf in 1 of its 21 elements"):
        ops.quantize_per_tensor(x, 0.1, 0, 0, 255, torch.uint8)
