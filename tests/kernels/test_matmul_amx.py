"""native_matmul.c on AMX tiles (native_amx.c's lucid_amx_sums): attention's products of more than 8 rows run on the
tiles, their inputs zero-padded to a multiple of 64 and their rows to 32, and give the VNNI kernels' codes and the
oracle's bit for bit, with one multiplier or one a row (softmax_matmul's)."""

import pytest
import torch

from lucid_fx.kernels import linear_native as ln
from lucid_fx.kernels import matmul_native as mn
from lucid_fx.kernels import program_ops
from lucid_fx.kernels import softmax_matmul as sm
from _grid import random_codes


def _on_tiles(fn):
    """fn() with the tiles on and off: (its value on them, whether they ran it, its value on the VNNI kernels)."""
    before = ln.amx_calls()
    on = fn()
    ran = ln.amx_calls() - before
    ln.use_amx(False)
    try:
        off = fn()
    finally:
        ln.use_amx(True)
    return on, ran, off


CASES = {  # (a, b) of codes: attention's layouts, rows past 32 and inputs past 64
    "q @ k^T, 128 keys of 64": lambda d: (random_codes((2, 4, 128, 64), d, 0),
                                          random_codes((2, 4, 128, 64), d, 1).transpose(-1, -2)),
    "p @ v, 40 rows of 100": lambda d: (random_codes((3, 40, 100), d, 0), random_codes((3, 100, 40), d, 1)),
    "9 rows, 17 inputs, 16 columns": lambda d: (random_codes((9, 17), d, 0), random_codes((17, 16), d, 1)),
    "33 rows, 65 inputs, 50 columns": lambda d: (random_codes((2, 33, 65), d, 0), random_codes((2, 65, 50), d, 1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype,zps,out_zp", [(torch.uint8, (128, 3), 100), (torch.int8, (-5, 7), 0)])
def test_products_of_more_than_8_rows_run_on_the_tiles_with_the_same_codes(amx, case, dtype, zps, out_zp):
    a, b = CASES[case](dtype)
    plan = mn.matmul_plan(a, b, *zps)
    assert plan is not None
    sums = torch.matmul(a.double() - zps[0], b.double() - zps[1])
    mult = 100.0 / float(sums.abs().max())
    low, high = program_ops.code_bounds(dtype, out_zp, "none")
    got, ran, vnni = _on_tiles(lambda: mn.matmul_codes(a, zps[0], b, zps[1], mult, out_zp, low, high, dtype, plan))
    want = program_ops.matmul_codes(a, zps[0], b, zps[1], mult, out_zp, low, high, dtype)
    assert ran == 1 and torch.equal(got, want) and torch.equal(vnni, want), int((got != want).sum())
    assert want.unique().numel() > 20  # codes across the grid


def test_8_rows_stay_on_the_vnni_kernels(amx):
    a, b = random_codes((8, 64), torch.uint8, 0), random_codes((64, 32), torch.uint8, 1)
    plan = mn.matmul_plan(a, b, 128, 128)
    got, ran, vnni = _on_tiles(lambda: mn.matmul_codes(a, 128, b, 128, 0.01, 128, 0, 255, torch.uint8, plan))
    assert ran == 0 and torch.equal(got, vnni)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_softmax_matmul_s_rows_multipliers_on_the_tiles(amx, dtype):
    e_zp, v_zp = int(torch.iinfo(dtype).min), (125 if dtype == torch.uint8 else -5)
    e = (random_codes((2, 4, 40, 72), torch.uint8, 0).int() + e_zp).to(dtype)
    v = random_codes((2, 4, 72, 48), dtype, 1)  # a whole pair of blocks (16 lanes at a time), then one alone
    plan = sm.rows_plan(e, v, e_zp, v_zp)
    rmult = (60.0 / torch.matmul(e.double() - e_zp, v.double() - v_zp).abs().amax(-1).clamp_min(1)).float()
    rmult.view(-1)[0] = 0.0  # a row that kept nothing
    zp = 128 if dtype == torch.uint8 else 0
    low, high = program_ops.code_bounds(dtype, zp, "none")
    got, ran, vnni = _on_tiles(lambda: sm.matmul_rows(e, e_zp, v, v_zp, rmult, zp, low, high, dtype, plan))
    want = sm.torch_matmul_rows(e, e_zp, v, v_zp, rmult, zp, low, high, dtype)
    assert ran == 1 and torch.equal(got, want) and torch.equal(vnni, want), int((got != want).sum())
