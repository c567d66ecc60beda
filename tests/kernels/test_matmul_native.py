"""lucid_fx/kernels/matmul_native.py and native_matmul.c: the product of two code tensors in exact int32
sums gives program_ops.matmul_codes's codes bit for bit, on this CPU's build and the portable one,
for every batch broadcast, stride and tail; the plan declines what float32 would not sum exactly."""

import pytest
import torch

from lucid_fx.kernels import matmul_native as mn
from lucid_fx.kernels import program_ops
from _grid import random_codes


@pytest.fixture
def no_fallback(forbid_route):
    forbid_route(mn.native, "matmul_codes")  # what passes ran native_matmul.c


_codes = random_codes


CASES = {  # (a, b) of codes of dtype d: attention's shapes and layouts, and odd sizes for the tails
    "q @ k^T, heads transposed": lambda d: (_codes((2, 17, 4, 16), d, 0).transpose(1, 2),
                                            _codes((2, 17, 4, 16), d, 1).permute(0, 2, 3, 1)),
    "p @ v": lambda d: (_codes((2, 4, 17, 17), d, 0), _codes((2, 17, 4, 16), d, 1).transpose(1, 2)),
    "2-d, odd sizes": lambda d: (_codes((5, 33), d, 0), _codes((33, 7), d, 1)),
    "broadcast batch": lambda d: (_codes((3, 2, 6, 9), d, 0), _codes((2, 9, 5), d, 1)),
    "both broadcast": lambda d: (_codes((3, 1, 6, 9), d, 0), _codes((1, 4, 9, 3), d, 1)),
    "expanded (repeat_kv)": lambda d: (_codes((2, 4, 8, 16), d, 0),
                                       _codes((2, 2, 1, 16, 8), d, 1).expand(2, 2, 2, 16, 8).reshape(2, 4, 16, 8)),
    "k of 1, n of 1": lambda d: (_codes((4, 1), d, 0), _codes((1, 1), d, 1)),
    "odd k, both operands transposed": lambda d: (_codes((3, 7, 5), d, 0).transpose(-1, -2),
                                                  _codes((3, 9, 7), d, 1).transpose(-1, -2)),
    "odd k, keys transposed, 40 keys": lambda d: (_codes((2, 6, 11), d, 0), _codes((2, 40, 11), d, 1).transpose(-1, -2)),
    "values of 40 columns, odd k": lambda d: (_codes((2, 6, 13), d, 0), _codes((2, 13, 40), d, 1)),
    "six dims": lambda d: (_codes((2, 1, 3, 2, 4, 5), d, 0), _codes((1, 2, 1, 2, 5, 3), d, 1)),
}


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "portable"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype,zps,out_zp", [(torch.uint8, (128, 0), 100), (torch.uint8, (3, 250), 0),
                                              (torch.int8, (0, -5), 0), (torch.int8, (-128, 127), -1)])
def test_the_product_equals_program_ops_bit_for_bit(native_build, no_fallback, build, case, dtype, zps, out_zp):
    native_build(build)
    a, b = CASES[case](dtype)
    plan = mn.matmul_plan(a, b, *zps)
    assert plan is not None and plan.out_shape == torch.matmul(a.float(), b.float()).shape
    sums = torch.matmul(a.double() - zps[0], b.double() - zps[1])
    spread = 100.0 / float(sums.abs().max().clamp_min(1))  # codes across the grid around its middle
    middle = 128 if dtype == torch.uint8 else 0
    # a power of two puts sums on exact ties; the spread's codes are not all clamped to one end
    for mult, zp in ((0.0017, out_zp), (1.0 / 3, out_zp), (2.0 ** -9, out_zp), (spread, middle)):
        low, high = program_ops.code_bounds(dtype, zp, "none")
        got = mn.matmul_codes(a, zps[0], b, zps[1], mult, zp, low, high, dtype, plan)
        expected = program_ops.matmul_codes(a, zps[0], b, zps[1], mult, zp, low, high, dtype)
        assert got.dtype == dtype and got.stride() == expected.stride()
        assert torch.equal(got, expected), f"{int((got != expected).sum())} codes differ"
    assert expected.unique().numel() >= min(10, expected.numel() // 2)


def test_sums_at_the_exact_limit_and_the_plan_past_it(native_on, no_fallback):
    # k * 255 * 255 <= 2^24 up to k = 258: every partial sum of codes 255 (zero point 0) times codes 0
    # (zero point 255, value -255) is exact in float32 there, so the two routes agree at the limit.
    k = mn.EXACT_SUM // (255 * 255)
    a, b = torch.full((2, k), 255, dtype=torch.uint8), torch.zeros((k, 3), dtype=torch.uint8)
    plan = mn.matmul_plan(a, b, 0, 255)
    got = mn.matmul_codes(a, 0, b, 255, 1e-6, 128, 0, 255, torch.uint8, plan)
    assert torch.equal(got, program_ops.matmul_codes(a, 0, b, 255, 1e-6, 128, 0, 255, torch.uint8))
    assert int(got[0, 0]) == round(128 - k * 255 * 255 * 1e-6)
    assert mn.matmul_plan(torch.zeros((2, k + 1), dtype=torch.uint8), torch.zeros((k + 1, 3), dtype=torch.uint8), 0, 255) is None
    assert mn.matmul_plan(torch.zeros((2, 1000), dtype=torch.uint8), torch.zeros((1000, 3), dtype=torch.uint8), 128, 128)


def test_the_plan_declines_what_the_kernel_does_not_take():
    u = torch.zeros((2, 3), dtype=torch.uint8)
    assert mn.matmul_plan(torch.zeros(3, dtype=torch.uint8), u.t(), 0, 0) is None  # a vector
    assert mn.matmul_plan(u, u.t().to(torch.int8), 0, 0) is None  # two code dtypes
    assert mn.matmul_plan(u.float(), u.t().float(), 0, 0) is None  # not codes
    assert mn.matmul_plan(u, u, 0, 0) is None  # 3 against 2
    assert mn.matmul_plan(torch.zeros((1,) * 5 + (2, 3), dtype=torch.uint8), u.t(), 0, 0) is None  # 5 batch dims
    assert mn.matmul_plan(torch.zeros((2, 2, 3), dtype=torch.uint8), torch.zeros((3, 3, 2), dtype=torch.uint8), 0, 0) is None
    for a, b in [((2, 0), (0, 3)), ((0, 2), (2, 3)), ((2, 2), (2, 0)), ((0, 2, 2), (2, 3))]:  # empty: the torch route
        assert mn.matmul_plan(torch.zeros(a, dtype=torch.uint8), torch.zeros(b, dtype=torch.uint8), 0, 0) is None


def test_operands_with_other_strides_than_planned_and_no_native_kernels_take_the_torch_route(native_env):
    a, b = CASES["p @ v"](torch.uint8)
    plan = mn.matmul_plan(a, b, 0, 128)
    expected = program_ops.matmul_codes(a, 0, b, 128, 0.01, 120, 0, 255, torch.uint8)
    native_env()
    assert torch.equal(mn.matmul_codes(a, 0, b.contiguous(), 128, 0.01, 120, 0, 255, torch.uint8, plan), expected)
    native_env(LUCID_FX_NATIVE="0")
    assert torch.equal(mn.matmul_codes(a, 0, b, 128, 0.01, 120, 0, 255, torch.uint8, plan), expected)


def test_a_programs_matmul_step_gives_the_unplanned_codes_and_refuses_other_strides(native_on):
    a, b = CASES["p @ v"](torch.uint8)
    matmul = mn.matmul_plan(a, b, 0, 128)
    step = mn.matmul_step(a, 0, b, 128, 0.01, 120, 0, 255, torch.uint8, matmul)
    expected = program_ops.matmul_codes(a, 0, b, 128, 0.01, 120, 0, 255, torch.uint8)
    assert torch.equal(step(a, b), expected) and step(a, b).is_contiguous()
    assert not b.is_contiguous() and step(a, b.contiguous()) is None  # other strides: the checked route
    assert torch.equal(mn.matmul_codes(a, 0, b, 128, 0.01, 120, 0, 255, torch.uint8, matmul, plan=step), expected)
    assert mn.matmul_step(a.to(torch.int8), 0, b, 128, 0.01, 120, -128, 127, torch.int8, matmul) is None  # dtypes
