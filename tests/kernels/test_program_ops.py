"""The run-time functions of lowered programs give the reference kernels' codes (lucid_fx/kernels/program_ops.py)."""

import math

import pytest
import torch
import torch.nn.functional as F

from lucid_fx.kernels import KernelInputError
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.program_ops import (add_codes, global_avg_pool_codes, matmul_codes, max_pool_taps,
                                          max_pool_taps_supported, mul_codes, quantize_codes, requantize_codes,
                                          softmax_codes, softmax_table)


@pytest.mark.parametrize("zp", [0, 3, 128, 7])
@pytest.mark.parametrize("dtype,qmin,qmax", [(torch.uint8, 0, 255), (torch.int8, -128, 127), (torch.uint8, 0, 15)])
def test_quantize_codes_equals_the_reference_bit_for_bit(zp, dtype, qmin, qmax):
    zp = min(max(zp, qmin), qmax)
    scale = 0.037
    torch.manual_seed(zp)
    x = torch.randn(20000) * 3
    # Values at and next to rounding ties, where the magic-number add and round-half-even could part.
    ties = (torch.arange(-300, 300, dtype=torch.float32) + 0.5) * scale
    x = torch.cat([x, ties, torch.nextafter(ties, ties + 1), torch.nextafter(ties, ties - 1),
                   torch.tensor([0.0, -0.0, 1e30, -1e30])])
    expected = ref.quantize_per_tensor(x, scale, zp, qmin, qmax, dtype)
    got = quantize_codes(x, ref.f32_reciprocal(scale), zp, qmin, qmax, dtype)
    assert got.dtype == dtype
    assert torch.equal(got, expected), int((got.int() - expected.int()).abs().max())


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_quantize_codes_refuses_non_finite_values(bad):
    x = torch.randn(64)
    x[5] = bad
    with pytest.raises(KernelInputError, match=r"quantize_per_tensor"):
        quantize_codes(x, 10.0, 0, 0, 255, torch.uint8)


@pytest.mark.parametrize("kernel,stride,padding", [([3, 3], [2, 2], [1, 1]), ([2, 2], [2, 2], [0, 0]),
                                                   ([3, 2], [1, 2], [1, 0]), ([5, 5], [3, 3], [2, 2])])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_max_pool_taps_equals_max_pool2d(kernel, stride, padding, dtype):
    torch.manual_seed(1)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    q = torch.randint(lo, hi, (2, 5, 17, 13), dtype=dtype)
    assert max_pool_taps_supported(kernel, stride, padding, [1, 1], False)
    expected = F.max_pool2d(q.float(), kernel, stride, padding).to(dtype)
    assert torch.equal(max_pool_taps(q, kernel, stride, padding), expected)
    cl = q.contiguous(memory_format=torch.channels_last)
    assert torch.equal(max_pool_taps(cl, kernel, stride, padding), expected)


def test_max_pool_taps_declines_what_it_cannot_compute_exactly():
    assert not max_pool_taps_supported([3, 3], [2, 2], [1, 1], [2, 2], False)  # dilation
    assert not max_pool_taps_supported([3, 3], [2, 2], [1, 1], [1, 1], True)  # ceil mode
    assert not max_pool_taps_supported([2, 2], [2, 2], [1, 1], [1, 1], False)  # a window of padding only
    assert not max_pool_taps_supported([3], [2], [1], [1], False)  # 1-d


@pytest.mark.parametrize("dtype,zp,out_zp", [(torch.uint8, 0, 0), (torch.uint8, 131, 7), (torch.int8, -3, 2)])
def test_global_avg_pool_codes_is_within_one_code_of_the_reference(dtype, zp, out_zp):
    torch.manual_seed(2)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    q = torch.randint(lo, hi, (3, 16, 7, 9), dtype=dtype)
    expected = ref.adaptive_avg_pool2d(q, 0.05, zp, [1, 1], 0.04, out_zp)
    got = global_avg_pool_codes(q, 0.05, zp, 0.04, out_zp)
    assert got.shape == expected.shape == (3, 16, 1, 1) and got.dtype == dtype
    diff = (got.int() - expected.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.05


@pytest.mark.parametrize("zp", [0, 7, 128])
@pytest.mark.parametrize("post_op", ["none", "relu"])
def test_add_and_mul_codes_equal_the_cpu_kernels(zp, post_op):
    from lucid_fx.kernels import cpu_float

    torch.manual_seed(zp)
    qa = torch.randint(0, 256, (2, 48, 9, 7), dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
    qb = torch.randint(0, 256, (2, 48, 1, 1), dtype=torch.uint8)  # squeeze-excite's broadcast
    qc = torch.randint(0, 256, (2, 48, 9, 7), dtype=torch.uint8)
    low = zp if post_op == "relu" else 0
    expected = cpu_float.mul(qa, 0.1, 3, qb, 0.013, 5, 0.05, zp, post_op)
    got = mul_codes(qa, 3, qb, 5, 0.1 * 0.013 / 0.05, zp, low, 255, torch.uint8)
    assert torch.equal(got, expected) and got.stride() == expected.stride()
    expected = cpu_float.add(qa, 0.1, 3, qc, 0.07, 120, 0.05, zp, post_op)
    got = add_codes(qa, 3, 0.1 / 0.05, qc, 120, 0.07 / 0.05, zp, low, 255, torch.uint8)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("zp", [0, 3])
def test_matmul_and_softmax_codes_equal_the_cpu_kernels(zp):
    from lucid_fx.kernels import cpu_float

    torch.manual_seed(zp)
    qa = torch.randint(0, 256, (2, 4, 16, 8), dtype=torch.uint8)
    qb = torch.randint(0, 256, (2, 4, 8, 16), dtype=torch.uint8)
    expected = cpu_float.matmul(qa, 0.02, 130, qb, 0.03, 127, 0.4, zp)
    assert torch.equal(matmul_codes(qa, 130, qb, 127, 0.02 * 0.03 / 0.4, zp, 0, 255, torch.uint8), expected)
    expected = cpu_float.softmax(qa, 0.05, 128, -1, 1 / 256, zp)
    assert torch.equal(softmax_codes(qa, softmax_table(0.05), -1, 1.0 / (1 / 256), zp, 0, 255, torch.uint8), expected)


def test_requantize_codes_rounds_ties_to_even_for_odd_and_even_zero_points():
    y = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 300.0, -300.0, 2.4999998])
    for zp in (0, 1, 7, 128):
        expected = (y.round() + zp).clamp(0, 255).to(torch.uint8)
        assert torch.equal(requantize_codes(y.clone(), zp, 0, 255, torch.uint8), expected), zp
