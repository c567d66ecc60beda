"""The padding that CUDA's torch._int_mm needs (M > 16, K and N multiples of 8), checked on CPU,
where torch._int_mm runs on any shape: padded products must equal exact integer products."""

import pytest
import torch
import torch.nn.functional as F

import lucid_fx.quantization as Q
from lucid_fx.kernels import int_mm

ops = torch.ops.lucid_fx


def _int8(*shape, seed=0):
    return torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("k", [3, 13, 16])
@pytest.mark.parametrize("n", [7, 8])
@pytest.mark.parametrize("column_major", [True, False])
def test_padded_int_mm_equals_the_exact_product(m, k, n, column_major):
    a = _int8(m, k)
    b = _int8(n, k, seed=1).t() if column_major else _int8(k, n, seed=1)
    a_p, b_p, rows, cols = int_mm.pad_for_int_mm(a, b)
    assert a_p.shape[0] > 16 and a_p.shape[1] % 8 == 0 and b_p.shape[1] % 8 == 0
    assert (rows, cols) == (m, n) and a_p.shape[1] == b_p.shape[0]
    assert b_p.t().is_contiguous() == column_major  # the operand keeps its layout
    assert torch.equal(a_p[:m, :k], a) and torch.equal(b_p[:k, :n], b)
    assert a_p[m:].abs().sum() == 0 and a_p[:, k:].abs().sum() == 0 and b_p[k:].abs().sum() == 0
    exact = (a.long() @ b.long()).int()
    assert torch.equal((a_p.long() @ b_p.long())[:rows, :cols].int(), exact)  # the padding adds nothing
    assert torch.equal(int_mm.int_mm_padded(a, b), exact)


def test_int_mm_is_exact_for_wide_right_operands_on_every_cpu():
    # oneDNN's _int_mm on a CPU without VNNI sums pairs of products in int16 with saturation; the
    # halves of split_for_int16_pairs stay within [-64, 64], where it is exact.
    a, b = torch.full((3, 64), 127, dtype=torch.int8), torch.full((64, 5), -128, dtype=torch.int8)
    halves = int_mm.split_for_int16_pairs(b)
    if halves is not None:
        assert torch.equal(halves.sum(0), b) and int(halves.abs().max()) <= 64
    assert torch.equal(int_mm.int_mm_padded(a, b), torch.full((3, 5), 127 * -128 * 64, dtype=torch.int32))


def test_valid_shapes_are_not_copied():
    a, b = _int8(32, 16), _int8(16, 8)
    a_p, b_p, _, _ = int_mm.pad_for_int_mm(a, b)
    assert a_p is a and b_p is b


def test_pre_padded_weight_pads_only_the_activation():
    a, w = _int8(5, 13), _int8(7, 13, seed=1)
    b_pre = int_mm.pad_for_int_mm(_int8(17, 13), w.t())[1]  # (16, 8), as the weight cache holds it
    a_p, b_p, m, n = int_mm.pad_for_int_mm(a, b_pre)
    assert b_p is b_pre and a_p.shape == (17, 16)
    assert torch.equal(int_mm.int_mm_padded(a, b_pre)[:m, :7], (a.long() @ w.long().t()).int())
    with pytest.raises(ValueError, match="columns"):
        int_mm.pad_for_int_mm(_int8(5, 20), b_pre)


def test_int_mm_padding_rounds_up():
    assert int_mm.int_mm_padding(1, 3, 7) == (17, 8, 8)
    assert int_mm.int_mm_padding(17, 13, 9) == (17, 16, 16)
    assert int_mm.int_mm_padding(64, 32, 64) == (64, 32, 64)


# The CUDA kernels themselves (pad=True), run on CPU against a float oracle.


def _act(shape, seed=0):
    return Q.quantize(torch.randn(shape, generator=torch.Generator().manual_seed(seed)), 0.04, 117, "quint8"), 0.04, 117


def _weight(shape):
    qw = torch.randint(-128, 128, shape, dtype=torch.int8, generator=torch.Generator().manual_seed(5))
    return qw, torch.rand(shape[0], generator=torch.Generator().manual_seed(6)) * 0.01 + 0.001


def _deq_w(qw, ws):
    return Q.dequantize(qw, ws, torch.zeros_like(ws, dtype=torch.int64), ch_axis=0)


@pytest.mark.parametrize("shape", [(1, 13), (5, 13), (2, 3, 13), (17, 3)])
@pytest.mark.parametrize("post_op", ["none", "relu"])
def test_padded_linear_matches_float(shape, post_op):
    qx, xs, xz = _act(shape)
    qw, ws = _weight((7, shape[-1]))  # full int8 range: _int_mm accumulates in int32, no saturation
    bias = torch.randn(7)
    out = int_mm.int8_linear(qx, xs, xz, qw, ws, bias, 1.0, 0, post_op, torch.float32, pad=True)
    y = F.linear(Q.dequantize(qx, xs, xz), _deq_w(qw, ws), bias)
    torch.testing.assert_close(out, y.relu() if post_op == "relu" else y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("groups,stride,padding", [(1, 2, 1), (1, 1, 0), (3, 1, 1)])
def test_padded_conv_matches_float(groups, stride, padding):
    qx, xs, xz = _act((2, 3, 7, 6))
    qw, ws = _weight((5 * groups, 3 // groups, 3, 3))
    out = int_mm.int8_conv(qx, xs, xz, qw, ws, None, [stride] * 2, [padding] * 2, [1, 1], groups, 1.0, 0, "none",
                         torch.float32, pad=True)
    y = F.conv2d(Q.dequantize(qx, xs, xz), _deq_w(qw, ws), None, stride, padding, 1, groups)
    torch.testing.assert_close(out, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1), (4, 1)])
def test_one_input_feature_is_exact_on_the_cpu_path(shape):
    # torch._int_mm on CPU returns garbage for K == 1 (2.13: -339796496 for 72 * 100): an outer product instead.
    qx, xs, xz = _act(shape)
    qw, ws = _weight((5, 1))
    out = int_mm.int8_linear(qx, xs, xz, qw, ws, None, 1.0, 0, "none", torch.float32, pad=False)
    torch.testing.assert_close(out, F.linear(Q.dequantize(qx, xs, xz), _deq_w(qw, ws)), rtol=1e-5, atol=1e-5)
