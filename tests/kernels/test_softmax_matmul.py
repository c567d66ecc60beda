"""lucid_fx/kernels/softmax_matmul.py: softmax(s) @ v with each row's probabilities on a grid of their own.

The reference against the float computation, and against the fixed grid it replaces; the CPU kernel
against the reference (a step apart at most, where the table's rounding moves an exponential); the
native steps (native_softmax.c's softmax_exp, native_matmul.c's multiplier a row) against their torch
routes bit for bit on every build; masks as masked_softmax reads them."""

import pytest
import torch

from lucid_fx.kernels import softmax_matmul as sm
from lucid_fx.kernels import softmax_native
from lucid_fx.kernels.program_ops import code_bounds
from _grid import random_codes

ops = torch.ops.lucid_fx
NEG_INF = float("-inf")


def _sqnr(expected: torch.Tensor, got: torch.Tensor) -> float:
    return float(10 * torch.log10(expected.pow(2).sum() / (expected - got).pow(2).sum()))


def _attention(seed: int = 0, heads: int = 4, keys: int = 128, width: int = 32):
    """Scores with a spread of about 3 (rows spread over many keys, as an untrained model's) and values."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(2, heads, 16, keys, generator=g)
    v = torch.randn(2, heads, keys, width, generator=g)
    qs = torch.ops.lucid_fx.quantize_per_tensor(s, 6 / 255, 128, 0, 255, torch.uint8)
    qv = torch.ops.lucid_fx.quantize_per_tensor(v, 8 / 255, 128, 0, 255, torch.uint8)
    return s, v, qs, qv


def _float(qs, qv, mask=None):
    s = ops.dequantize_per_tensor(qs, 6 / 255, 128)
    s = s if mask is None else s.masked_fill(mask, NEG_INF)
    return torch.softmax(s, -1).nan_to_num(nan=0.0) @ ops.dequantize_per_tensor(qv, 8 / 255, 128)


def test_rows_of_spread_probabilities_keep_their_precision_where_the_fixed_grid_loses_it():
    _, _, qs, qv = _attention()
    expected = _float(qs, qv)
    out_scale = float(expected.abs().max()) / 127
    fused = ops.dequantize_per_tensor(ops.softmax_matmul(qs, 6 / 255, 128, None, None, qv, 8 / 255, 128, out_scale, 128),
                                      out_scale, 128)
    p = ops.softmax(qs, 6 / 255, 128, -1, 1 / 256, 0)  # the fixed grid, then the product
    fixed = ops.dequantize_per_tensor(ops.matmul(p, 1 / 256, 0, qv, 8 / 255, 128, out_scale, 128), out_scale, 128)
    rounded = ops.dequantize_per_tensor(ops.quantize_per_tensor(expected, out_scale, 128, 0, 255, torch.uint8), out_scale, 128)
    print(_sqnr(expected, fused), _sqnr(expected, fixed), _sqnr(expected, rounded))
    assert _sqnr(expected, fused) > _sqnr(expected, rounded) - 1.5  # about the output's own rounding alone
    assert _sqnr(expected, fused) > _sqnr(expected, fixed) + 15


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("masked", ["none", "bool -inf", "bool -1e9", "bias"])
def test_the_cpu_kernel_is_the_reference_within_a_step(dtype, masked):
    q, v = random_codes((2, 3, 24, 300), dtype, 0), random_codes((2, 3, 300, 40), dtype, 1)
    zp = 5 if dtype == torch.uint8 else -3
    g = torch.Generator().manual_seed(2)
    mask, fill = None, None
    if masked.startswith("bool"):
        mask, fill = torch.rand(2, 1, 1, 300, generator=g) < 0.4, NEG_INF if masked == "bool -inf" else -1e9
        mask[1, 0, 0, :] = True  # one batch masked everywhere: zeros (-inf) or uniform (-1e9), as in float
    elif masked == "bias":
        mask = torch.randn(1, 3, 24, 300, generator=g)
    args = (q, 0.03, zp, mask, fill, v, 0.02, zp + 7, 0.01, zp)
    expected, got = sm.softmax_matmul(*args), sm.cpu_softmax_matmul(*args)
    assert got.dtype == dtype and got.shape == expected.shape == (2, 3, 24, 40) and got.is_contiguous()
    diff = (got.int() - expected.int()).abs()
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.01
    assert torch.equal(ops.softmax_matmul(*args), got)  # the dispatcher serves the CPU kernel
    assert expected.unique().numel() > 50  # codes across the grid, not one clamped end


def test_a_row_masked_everywhere_with_minus_infinity_gives_the_zero_point():
    q, v = random_codes((1, 2, 4, 8), torch.uint8, 3), random_codes((1, 2, 8, 5), torch.uint8, 4)
    mask = torch.zeros(1, 1, 4, 8, dtype=torch.bool)
    mask[0, 0, 2] = True
    for kernel in (sm.softmax_matmul, sm.cpu_softmax_matmul):
        out = kernel(q, 0.1, 0, mask, NEG_INF, v, 0.05, 128, 0.05, 77)
        assert torch.equal(out[:, :, 2], torch.full((1, 2, 5), 77, dtype=torch.uint8))
        assert (out[:, :, :2] != 77).any()


def test_a_fill_value_needs_a_bool_mask():
    q = random_codes((1, 4, 8), torch.uint8, 0)
    with pytest.raises(ValueError, match="must be torch.bool"):
        sm.cpu_softmax_matmul(q, 0.1, 0, torch.zeros(1, 4, 8), NEG_INF, random_codes((1, 8, 3), torch.uint8, 1),
                              0.1, 0, 0.1, 0)


def test_the_exponentials_table_puts_a_rows_largest_at_the_top_code():
    table = sm.exp_table(0.1)
    assert table.dtype == torch.uint8 and table.numel() == 256
    assert table[:3].tolist() == [255, 231, 209]  # 255 * exp(-0.1 d), rounded
    assert int(table[-1]) == 0


def test_probabilities_qdq_rounds_each_rows_exponentials_and_renormalises():
    p = torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.0, 0.0]])
    e = torch.tensor([255.0, 153.0, 102.0])  # 255 * p / 0.5
    expected = torch.stack([e / e.sum(), torch.zeros(3)])
    assert torch.allclose(ops.probabilities_qdq(p), expected, rtol=0, atol=1e-7)
    assert ops.probabilities_qdq(torch.softmax(torch.randn(4, 16), -1)).sum(-1).sub(1).abs().max() < 1e-6


def test_the_fake_kernel_gives_the_broadcast_shape_and_the_values_dtype():
    q = torch.empty(2, 1, 5, 7, dtype=torch.uint8, device="meta")
    mask = torch.empty(1, 3, 1, 7, dtype=torch.bool, device="meta")
    v = torch.empty(7, 4, dtype=torch.uint8, device="meta")
    out = ops.softmax_matmul(q, 0.1, 0, mask, NEG_INF, v, 0.1, 0, 0.1, 0)
    assert out.shape == (2, 3, 5, 4) and out.dtype == torch.uint8


# ---- the native steps against their torch routes ----

BUILDS = ["this CPU", "no VNNI", "no AVX-512", "portable"]


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("keys", [1, 63, 64, 200, 300])
def test_the_native_exponentials_are_the_torch_routes_bit_for_bit(native_build, forbid_route, build, dtype, keys):
    native_build(build)
    torch_route = sm.torch_exp_codes
    forbid_route(sm, "torch_exp_codes")
    q = random_codes((3, 5, keys), dtype, keys)
    keep = torch.rand(3, 5, keys, generator=torch.Generator().manual_seed(1)) < 0.7
    keep[1, 2] = False  # a row that keeps nothing: multiplier 0
    e_zp = int(torch.iinfo(dtype).min)
    for kept in (None, keep):
        table = sm.exp_table(0.04)
        got = sm.exp_codes(q, table, kept, 0.37, e_zp, dtype)
        expected = torch_route(q, table, kept, 0.37, e_zp, dtype)
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
        assert got[0].dtype == dtype and got[1].dtype == torch.float32
    assert float(got[1][1, 2]) == 0.0 and bool((got[0][1, 2] == e_zp).all())
    first = sm.exp_codes(q, table, None, 0.37, e_zp, dtype)[0]
    assert bool(((first.int() - e_zp).amax(-1) == 255).all())  # each row's largest score is e = 1, code 255


MATMUL_CASES = {  # (e's shape, v as made, e's zero point is the dtype's least)
    "p @ v, values transposed from heads": ((2, 4, 17, 33), lambda d: random_codes((2, 33, 4, 16), d, 1).transpose(1, 2)),
    "2-d, odd sizes": ((5, 9), lambda d: random_codes((9, 7), d, 1)),
    "v broadcast over heads": ((2, 3, 6, 9), lambda d: random_codes((2, 1, 9, 40), d, 1)),
    "k past float32's exact sums": ((2, 8, 300), lambda d: random_codes((2, 300, 20), d, 1)),
}


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("case", sorted(MATMUL_CASES))
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_the_product_with_a_multiplier_a_row_is_the_torch_routes_bit_for_bit(native_build, forbid_route, build, case, dtype):
    native_build(build)
    torch_route = sm.torch_matmul_rows
    forbid_route(sm, "torch_matmul_rows")  # what passes ran native_matmul.c
    shape, make_v = MATMUL_CASES[case]
    e_zp, v_zp = int(torch.iinfo(dtype).min), (125 if dtype == torch.uint8 else -5)  # sums of both signs
    e = (random_codes(shape, torch.uint8, 0).int() + e_zp).to(dtype)  # 0..255 above e_zp
    v = make_v(dtype)
    plan = sm.rows_plan(e, v, e_zp, v_zp)
    assert plan is not None
    sums = torch.matmul(e.double() - e_zp, v.double() - v_zp)
    rmult = (60.0 / sums.abs().amax(-1).clamp_min(1)).float()  # codes across the grid
    rmult.view(-1)[0] = 0.0  # a row that kept nothing
    for zp in (0, 1) if dtype == torch.int8 else (128, 7):
        low, high = code_bounds(dtype, zp, "none")
        got = sm.matmul_rows(e, e_zp, v, v_zp, rmult, zp, low, high, dtype, plan)
        expected = torch_route(e, e_zp, v, v_zp, rmult, zp, low, high, dtype)
        assert got.shape == expected.shape and torch.equal(got, expected), f"{int((got != expected).sum())} codes differ"
        assert expected.unique().numel() > min(20, expected.numel() // 3)  # codes across the grid


def test_the_plan_declines_a_broadcast_of_the_rows():
    e = torch.empty(1, 6, 9, dtype=torch.uint8)
    assert sm.rows_plan(e, torch.empty(3, 9, 4, dtype=torch.uint8), 0, 0) is None  # a multiplier a row of e, not of the output
    assert sm.rows_plan(torch.empty(3, 6, 9, dtype=torch.uint8), torch.empty(1, 9, 4, dtype=torch.uint8), 0, 0) is not None


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_the_native_exponentials_of_float_scores_are_the_torch_routes_within_a_code(native_build, forbid_route, build,
                                                                                    dtype):
    # a small masked attention's route (a bias, or a mask too small for the table's check to pay)
    native_build(build)
    torch_route = sm.torch_exp_codes_float
    forbid_route(sm, "torch_exp_codes_float")  # what passes ran softmax_exp_float
    g = torch.Generator().manual_seed(3)
    y = torch.randn(4, 6, 37, generator=g) * 3
    y[0, 1] = float("-inf")  # a row masked everywhere: multiplier 0
    y[1, 2, :30] = float("-inf")
    e_zp = int(torch.iinfo(dtype).min)
    got, got_mult = sm.exp_codes_float(y.clone(), 0.37, e_zp, dtype)
    expected, expected_mult = torch_route(y.clone(), 0.37, e_zp, dtype)
    diff = (got.int() - expected.int()).abs()
    assert got.dtype == dtype and int(diff.max()) <= 1 and int((diff > 0).sum()) <= 2  # native_softmax.c's exp and torch's
    assert torch.allclose(got_mult, expected_mult, rtol=0.01) and float(got_mult[0, 1]) == 0.0
    assert bool((got[0, 1] == e_zp).all()) and bool(((got.int() - e_zp).amax(-1)[1:] == 255).all())


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("shape, bias_shape", [((2, 4, 16, 16), (2, 1, 1, 16)), ((8, 16, 37), (8, 1, 37)),
                                               ((5, 300), (300,)), ((2, 3, 7, 9), (2, 3, 7, 9)),
                                               ((2, 3, 7, 1100), (1, 1, 7, 1))])
def test_the_exponentials_of_codes_and_a_bias_are_the_torch_routes_bit_for_bit(native_build, build, dtype, shape,
                                                                            bias_shape):
    # BERT's additive padding mask: the scores' floats made in the kernel, as torch makes them, then the same
    # codes and multipliers as the torch route's (its exponentials Sleef's, the kernel's its own: no tie here)
    native_build(build)
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    q = random_codes(shape, dtype, shape[-1])
    bias = torch.randn(bias_shape, generator=g)
    bias[bias > 0.8] = torch.finfo(torch.float32).min  # padding, as transformers writes it
    bias.view(-1)[:2] = NEG_INF
    zp, e_zp = (9 if dtype == torch.uint8 else -4), int(torch.iinfo(dtype).min)
    got = sm.exp_codes_bias(q, zp, 0.05, bias, 0.37, e_zp, dtype)
    y = (q.to(torch.float32) - zp) * 0.05 + bias
    expected = sm.torch_exp_codes_float(y, 0.37, e_zp, dtype)
    assert got is not None and torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert int((got[0].int() - e_zp).amax()) == 255  # each row's largest at the top code


def test_the_bias_route_declines_what_its_kernel_does_not_take(native_on):
    q = random_codes((2, 4, 16, 16), torch.uint8, 0)
    bias = torch.zeros(2, 1, 1, 16)
    assert sm.exp_codes_bias(q, 0, 0.1, bias, 1.0, 0, torch.uint8) is not None
    assert sm.exp_codes_bias(q, 0, 0.1, bias.double(), 1.0, 0, torch.uint8) is None  # not float32
    assert sm.exp_codes_bias(q, 0, 0.1, torch.zeros(2, 1, 16, 1).transpose(-1, -2), 1.0, 0, torch.uint8) is not None
    assert sm.exp_codes_bias(q, 0, 0.1, torch.zeros(2, 1, 16, 2)[..., 0].unsqueeze(-2), 1.0, 0, torch.uint8) is None  # strided keys
    assert sm.exp_codes_bias(q[:1], 0, 0.1, bias, 1.0, 0, torch.uint8) is None  # the bias would widen the scores
    assert sm.exp_codes_bias(q.transpose(-1, -2), 0, 0.1, bias, 1.0, 0, torch.uint8) is None  # scores not dense
    assert sm.exp_codes_bias(q, 0, 0.1, bias, 1.0, -128, torch.int8) is None  # codes not of the dtype


def _routes_taken(monkeypatch) -> list:
    """The exponentials' routes cpu_softmax_matmul calls, in order (each still runs)."""
    taken = []
    for name in ("exp_codes_bias", "exp_codes", "exp_codes_float"):
        real = getattr(sm, name)
        monkeypatch.setattr(sm, name, lambda *a, real=real, name=name: taken.append(name) or real(*a))
    return taken


def _mask(kind: str) -> tuple:
    """(mask, fill) over 32 keys of 2 images: padding in the first, the second masked everywhere (a bool
    mask) or not at all (an ALiBi-like bias, which no table takes)."""
    if kind == "alibi":
        return -0.1 * torch.arange(32.0).expand(2, 1, 1, 32), None
    keep = torch.ones(2, 1, 1, 32, dtype=torch.bool)
    keep[0, ..., 20:] = False
    if kind == "bool -inf":  # transformers' BERT
        keep[1] = False
        return ~keep, NEG_INF
    return torch.zeros(2, 1, 1, 32).masked_fill_(~keep, torch.finfo(torch.float32).min), None  # BERT-like


@pytest.mark.parametrize("kind", ["bias", "bool -inf", "alibi"])
@pytest.mark.parametrize("heads", [2, 128])
def test_a_mask_that_is_a_bias_takes_the_bias_pass_below_its_threshold(native_on, monkeypatch, kind, heads):
    # 2 x heads x 16 x 32 scores: 2048 take the bias pass, 131072 (sm.BIAS_TABLE_MIN) the table where the
    # mask allows it; the bias pass's codes are the float route's bit for bit, the table's within a step
    q, v = random_codes((2, heads, 16, 32), torch.uint8, 5), random_codes((2, heads, 32, 8), torch.uint8, 6)
    mask, fill = _mask(kind)
    args = (q, 0.05, 128, mask, fill, v, 0.02, 128, 0.02, 128)
    taken = _routes_taken(monkeypatch)
    got = sm.cpu_softmax_matmul(*args)
    table = q.numel() >= sm.BIAS_TABLE_MIN and kind != "alibi"
    assert taken == (["exp_codes"] if table else ["exp_codes_bias"]) and (q.numel() >= sm.BIAS_TABLE_MIN) == (heads == 128)
    monkeypatch.setattr(sm, "exp_codes_bias", lambda *a: None)
    monkeypatch.setattr(sm, "BIAS_TABLE_MIN", 10 ** 12)
    floats = sm.cpu_softmax_matmul(*args)  # the float route: apply_mask, then the exponentials
    assert taken[-1] == "exp_codes_float"
    if table:
        assert int((got.int() - floats.int()).abs().max()) <= 1
    else:
        assert torch.equal(got, floats)


@pytest.mark.parametrize("heads, route", [(2, "float"), (4, "table")])
def test_a_masked_softmax_matmul_takes_the_table_route_from_its_own_threshold(monkeypatch, heads, route):
    # 2 x heads x 32 x 32 scores under a bool padding mask filling -1e9: 2048 take the float route, 4096
    # (sm.TABLE_MIN) the table's; the same codes
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (1, heads, 32, 32), dtype=torch.uint8, generator=g)
    v = torch.randint(0, 256, (1, heads, 32, 16), dtype=torch.uint8, generator=g)
    mask = torch.zeros(1, 1, 1, 32, dtype=torch.bool)
    mask[..., 20:] = True  # padding
    args = (q, 0.05, 128, mask, -1e9, v, 0.02, 128, 0.02, 128)
    taken = _routes_taken(monkeypatch)
    got = sm.cpu_softmax_matmul(*args)
    assert taken == ["exp_codes" if route == "table" else "exp_codes_float"]
    assert (q.numel() >= sm.TABLE_MIN) == (route == "table") and sm.TABLE_MIN < softmax_native.TABLE_MIN
    monkeypatch.setattr(sm, "TABLE_MIN", 1 if route == "float" else 10**9)  # the other route
    other = sm.cpu_softmax_matmul(*args)
    assert taken[-1] == ("exp_codes" if route == "float" else "exp_codes_float")
    assert int((got.int() - other.int()).abs().max()) <= 1


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_a_programs_unmasked_softmax_matmul_is_one_native_step_with_the_kernels_codes(native_on, dtype):
    q, v = random_codes((2, 3, 24, 300), dtype, 0), random_codes((2, 3, 40, 300), dtype, 1).transpose(-2, -1)
    zp = 5 if dtype == torch.uint8 else -3
    e = torch.empty(q.shape, dtype=dtype, device="meta")
    rows, table = sm.rows_plan(e, v, torch.iinfo(dtype).min, zp + 7), sm.exp_table(0.03)
    args = (q, 0.03, zp, None, None, v, 0.02, zp + 7, 0.01, zp, table, rows)
    step = sm.softmax_matmul_step(*args)
    expected = sm.cpu_softmax_matmul(*args)  # the kernel's route: exp_codes, then matmul_rows
    got = step(q, v)
    assert torch.equal(got, expected) and got.is_contiguous()
    assert torch.equal(sm.cpu_softmax_matmul(*args, plan=step), expected)
    assert step(q, v.contiguous()) is None  # v of other strides: the kernel's route
    mask = torch.zeros(1, 1, 1, 300, dtype=torch.bool)
    assert sm.softmax_matmul_step(q, 0.03, zp, mask, NEG_INF, *args[5:]) is None  # masks keep the kernel's route
