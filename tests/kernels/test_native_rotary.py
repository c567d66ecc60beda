"""lucid_fx/kernels/native_rotary.py and native_rotary.c: the rotary embedding in one pass gives the
codes of the eight calls it replaces (two products, two lookups, a cat, a sum) bit for bit, on this
CPU's build and the portable one, for both code dtypes, strided and broadcast operands, and either
order of the sum; operands of other strides take those calls."""

import pytest
import torch

from lucid_fx.kernels import native_elementwise, native_rotary, program_ops
from _grid import random_codes

CASES = {  # x's (batch, seq, heads, dim) transposed to (batch, heads, seq, dim), as llama's q; cos/sin shapes
    "llama, cos (1, 1, s, d)": ((2, 5, 4, 16), (1, 1, 5, 16)),
    "cos (s, d)": ((1, 7, 2, 8), (7, 8)),
    "cos per batch (b, 1, s, d)": ((3, 4, 2, 6), (3, 1, 4, 6)),
}


def _plan(x, c, s, dtype, seed, cos_first):
    g = torch.Generator().manual_seed(seed)
    low, high = program_ops.code_bounds(dtype, 0, "none")
    zps = torch.randint(low, high + 1, (9,), generator=g).tolist() if dtype == torch.int8 else torch.randint(90, 160, (9,), generator=g).tolist()
    mults = (torch.rand(4, generator=g) * 0.02 + 0.002).tolist()
    mul1 = (zps[0], zps[1], mults[0], zps[2], low, high)
    mul2 = (zps[3], zps[4], mults[1], zps[5], low, high)
    add = (zps[6], 0.5 + mults[2] * 20, zps[7], 0.5 + mults[3] * 20, zps[8], low, high)
    out = torch.empty(x.shape, dtype=dtype)
    return native_rotary.rotary_plan(x, c, s, out, mul1, mul2, add, cos_first)


@pytest.mark.parametrize("build", ["this CPU", "portable"])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8], ids=["uint8", "int8"])
@pytest.mark.parametrize("cos_first", [True, False], ids=["x*cos first", "rotated first"])
def test_one_pass_equals_the_calls_it_replaces_bit_for_bit(native_build, forbid_route, build, case, dtype, cos_first):
    if not native_elementwise.fused_add():
        pytest.skip("torch's add rounds twice on this CPU: programs keep the unfused sum (native_elementwise.fused_add)")
    native_build(build)
    shape, cos_shape = CASES[case]
    x = random_codes(shape, dtype, 1).transpose(1, 2)
    c, s = random_codes(cos_shape, dtype, 2), random_codes(cos_shape, dtype, 3)
    t_hi, t_lo = random_codes((256,), dtype, 4), random_codes((256,), dtype, 5)
    plan = _plan(x, c, s, dtype, 6, cos_first)
    expected = native_rotary._calls(x, c, s, t_hi, t_lo, plan)
    forbid_route(native_rotary, "_calls")  # what follows ran native_rotary.c
    got = native_rotary.rotary_codes(x, c, s, t_hi, t_lo, plan)
    assert got.dtype == dtype and got.shape == x.shape
    assert torch.equal(got, expected), f"{int((got != expected).sum())} of {got.numel()} codes differ"
    assert len(torch.unique(got)) > 20  # the numbers make a spread of codes, not one clamped value


def test_operands_of_other_strides_take_the_calls():
    dtype = torch.uint8
    x = random_codes((2, 5, 4, 16), dtype, 1).transpose(1, 2)
    c, s = random_codes((1, 1, 5, 16), dtype, 2), random_codes((1, 1, 5, 16), dtype, 3)
    t_hi, t_lo = random_codes((256,), dtype, 4), random_codes((256,), dtype, 5)
    plan = _plan(x, c, s, dtype, 6, True)
    dense = x.contiguous()  # the values the plan was built for, in another layout
    assert torch.equal(native_rotary.rotary_codes(dense, c, s, t_hi, t_lo, plan), native_rotary._calls(x, c, s, t_hi, t_lo, plan))


def test_a_plan_needs_an_even_last_dim_and_operands_that_broadcast():
    dtype = torch.uint8
    x, out = torch.empty(2, 3, 4, 6, dtype=dtype), torch.empty(2, 3, 4, 6, dtype=dtype)
    c = torch.empty(1, 1, 4, 6, dtype=dtype)
    numbers = ((0, 0, 0.1, 0, 0, 255), (0, 0, 0.1, 0, 0, 255), (0, 1.0, 0, 1.0, 0, 0, 255))
    assert native_rotary.rotary_plan(x, c, c, out, *numbers, True) is not None
    odd = torch.empty(2, 3, 4, 5, dtype=dtype)
    assert native_rotary.rotary_plan(odd, c[..., :5], c[..., :5], odd, *numbers, True) is None
    assert native_rotary.rotary_plan(x, torch.empty(1, 1, 3, 6, dtype=dtype), c, out, *numbers, True) is None
    assert native_rotary.rotary_plan(x[None], c, c, out[None], *numbers, True) is None  # 5 dims
