"""lucid_fx/kernels/softmax_native.py and native_softmax.c: the softmax of codes from a table of
exponentials gives program_ops.softmax_codes's codes bit for bit on this CPU's build and the
portable one, along any dim, for both code dtypes; and it stays within one code of the float
softmax (the reference kernel). The masked softmax takes the table route for padding and causal
masks (masked positions exactly 0) and the float route for biases."""

import math

import pytest
import torch

from lucid_fx.kernels import program_ops, softmax_native
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.attention import masked_softmax as ref_masked_softmax
from _grid import random_codes


TORCH_ROUTE = program_ops.softmax_codes


@pytest.fixture
def no_fallback(forbid_route):
    forbid_route(softmax_native.program_ops, "softmax_codes")  # what passes ran native_softmax.c


# rows of 33 (a tail alone), 128 and 255 (steps of 64 codes with VBMI, and a tail), 300 (int64 sums)
SHAPES = [((4, 2, 33, 33), -1), ((3, 17, 5), 1), ((4, 9, 6), 0), ((2, 255), -1), ((2, 300), -1), ((7, 1), -1),
          ((2, 3, 5, 128), -1)]


@pytest.mark.parametrize("build", ["this CPU", "no AVX-512", "portable"])
@pytest.mark.parametrize("shape,dim", SHAPES, ids=[f"{s}-dim{d}" for s, d in SHAPES])
@pytest.mark.parametrize("dtype,out_zp", [(torch.uint8, 0), (torch.uint8, 5), (torch.int8, -128)])
def test_the_native_softmax_equals_the_torch_route_bit_for_bit(native_build, no_fallback, build, shape, dim, dtype, out_zp):
    native_build(build)
    q = random_codes(shape, dtype, 0)
    low, high = program_ops.code_bounds(dtype, out_zp, "none")
    for scale in (0.011, 0.3, 4.0):  # 4.0: most of the table is 0, a row's largest code alone counts
        table = program_ops.softmax_table(scale)
        expected = TORCH_ROUTE(q, table, dim, 256.0, out_zp, low, high, dtype)
        got = softmax_native.softmax_codes(q, table, dim, 256.0, out_zp, low, high, dtype)
        assert got.dtype == dtype and got.shape == q.shape
        assert torch.equal(got, expected), f"{int((got != expected).sum())} codes differ"
    # over the positions a mask leaves (along this dim too, though masked_softmax_codes only takes the last)
    keep = torch.rand(shape, generator=torch.Generator().manual_seed(1)) > 0.3
    table = program_ops.softmax_table(0.3)
    got = softmax_native.softmax_codes(q, table, dim, 256.0, out_zp, low, high, dtype, keep)
    assert torch.equal(got, TORCH_ROUTE(q, table, dim, 256.0, out_zp, low, high, dtype, keep))
    assert bool((got[~keep] == max(out_zp, low)).all()), "a masked position is probability 0"


def test_the_table_is_exp_within_half_a_unit_of_its_fixed_point():
    for scale in (0.011, 0.3, 4.0):
        table = program_ops.softmax_table(scale)
        assert table.dtype == torch.int32 and table.shape == (256,) and table[0] == program_ops.EXP_ONE
        exact = torch.exp(torch.arange(256, dtype=torch.float64) * -scale) * program_ops.EXP_ONE
        assert (table.double() - exact).abs().max() <= 0.5
    assert int((program_ops.softmax_table(4.0) > 0).sum()) == math.ceil(math.log(2 * program_ops.EXP_ONE) / 4.0)


@pytest.mark.parametrize("dtype,zp", [(torch.uint8, 0), (torch.int8, -128)])
def test_the_codes_stay_within_one_step_of_the_float_softmax(dtype, zp):
    q = random_codes((8, 4, 64, 64), dtype, 1)
    for scale in (0.011, 0.05, 0.3):
        got = softmax_native.softmax_codes(q, program_ops.softmax_table(scale), -1, 256.0, zp,
                                           *program_ops.code_bounds(dtype, zp, "none"), dtype)
        expected = ref.softmax(q, scale, 0, -1, 1 / 256, zp)
        differ = got.to(torch.int32) - expected.to(torch.int32)
        assert differ.abs().max() <= 1 and (differ != 0).float().mean() < 1e-3


def test_codes_not_dense_take_the_torch_route():
    q = random_codes((6, 40), torch.uint8, 2)
    table = program_ops.softmax_table(0.1)
    strided = q.t()  # softmax along a dim that is not contiguous
    got = softmax_native.softmax_codes(strided, table, -1, 256.0, 0, 0, 255, torch.uint8)
    assert torch.equal(got, softmax_native.softmax_codes(strided.contiguous(), table, -1, 256.0, 0, 0, 255, torch.uint8))


def _masks():
    g = torch.Generator().manual_seed(3)
    pad = torch.ones(2, 16)
    pad[1, 11:] = 0
    row_masked = torch.zeros(2, 1, 16, 16, dtype=torch.bool).index_fill_(2, torch.tensor([3]), True)
    return {  # name: (mask, fill, whether the table route takes it)
        "padding, finfo.min": ((1 - pad)[:, None, None, :] * torch.finfo(torch.float32).min, None, True),
        "causal, -inf": (torch.full((16, 16), float("-inf")).triu(1), None, True),
        "padding, -1e4": ((1 - pad)[:, None, None, :] * -1e4, None, True),
        "bool, -inf": (torch.rand(2, 1, 16, 16, generator=g) < 0.3, float("-inf"), True),
        "bool, -1e9": (torch.rand(2, 1, 16, 16, generator=g) < 0.3, -1e9, True),
        "a row all -inf (bool)": (row_masked, float("-inf"), True),
        "a row all -inf (added)": (torch.zeros(2, 1, 16, 16).masked_fill_(row_masked, float("-inf")), None, True),
        "a row all -1e4 (added: a shift)": (torch.zeros(2, 1, 16, 16).masked_fill_(row_masked, -1e4), None, True),
        "a row all -1e9 (filled: uniform)": (row_masked, -1e9, False),
        "a bias (ALiBi)": (torch.randn(1, 4, 1, 16, generator=g), None, False),
        "-50: not past every score": ((1 - pad)[:, None, None, :] * -50.0, None, False),
    }


@pytest.mark.parametrize("build", ["this CPU", "portable"])
@pytest.mark.parametrize("name", sorted(_masks()))
def test_a_masked_softmax_is_the_table_softmax_over_what_the_mask_leaves(native_build, monkeypatch, build, name):
    native_build(build)
    monkeypatch.setattr(softmax_native, "TABLE_MIN", 0)  # these small scores take the table route too
    mask, fill, table_route = _masks()[name]
    q, scale = random_codes((2, 4, 16, 16), torch.uint8, 4), 0.05
    keep = program_ops.softmax_keep(q, scale, mask, fill, -1)
    assert (keep is not None) == table_route
    got = softmax_native.masked_softmax_codes(q, scale, 128, mask, fill, -1, 256.0, 0, 0, 255, torch.uint8)
    float_route = ref_masked_softmax(q, scale, 128, mask, fill, -1, 1 / 256, 0)
    differ = got.to(torch.int32) - float_route.to(torch.int32)
    assert differ.abs().max() <= 1 and (differ != 0).float().mean() < 0.01, name
    if table_route:
        assert torch.equal(got, TORCH_ROUTE(q, program_ops.softmax_table(scale), -1, 256.0, 0, 0, 255, torch.uint8, keep))
        assert bool((got[~keep] == 0).all()), "a masked position is probability 0"


def test_the_table_route_declines_another_dim_and_a_mask_that_broadcasts_the_scores():
    q = random_codes((2, 16, 16), torch.uint8, 5)
    mask = torch.zeros(2, 16, 16)
    assert program_ops.softmax_keep(q, 0.05, mask, None, -1) is not None
    assert program_ops.softmax_keep(q, 0.05, mask, None, 1) is None
    assert program_ops.softmax_keep(q, 0.05, torch.zeros(3, 2, 16, 16), None, -1) is None


def test_below_table_min_scores_a_masked_softmax_takes_the_float_route():
    mask, fill, _ = _masks()["padding, finfo.min"]
    q = random_codes((2, 4, 16, 16), torch.uint8, 6)
    assert q.numel() < softmax_native.TABLE_MIN
    got = softmax_native.masked_softmax_codes(q, 0.05, 128, mask, fill, -1, 256.0, 0, 0, 255, torch.uint8)
    y = program_ops.masked_softmax_float(q, 128, 0.05, mask, fill, -1)
    assert torch.equal(got, program_ops.requantize_codes(y.mul_(program_ops.operand(256.0)), 0, 0, 255, torch.uint8))
    big = random_codes((4, 8, 128, 128), torch.uint8, 7)
    big_mask = torch.zeros(4, 1, 1, 128).masked_fill_(torch.arange(128) >= 100, float("-inf"))
    keep = program_ops.softmax_keep(big, 0.05, big_mask, None, -1)
    assert torch.equal(softmax_native.masked_softmax_codes(big, 0.05, 128, big_mask, None, -1, 256.0, 0, 0, 255, torch.uint8),
                       TORCH_ROUTE(big, program_ops.softmax_table(0.05), -1, 256.0, 0, 0, 255, torch.uint8, keep))
