"""lucid_fx/kernels/native_amx.c: the GEMM on AMX tiles gives the exact int32 sums and the float steps of the VNNI
kernels, bit for bit, for every shape it takes (rows past a multiple of 32, odd last blocks, outputs past a multiple
of 16, tiles of rows, two threads), and takes only products of more than 8 rows with inputs a multiple of 64."""

import math

import pytest
import torch

from lucid_fx.kernels import linear_native as ln
from test_linear_native import FINISHES, _steps


def _case(m, k, n, seed=0):
    g = torch.Generator().manual_seed(seed + m * 7919 + k * 31 + n)
    q = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
    w = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g)
    w[0, :4], q[0, :4] = -128, 255  # the widest products
    offset = torch.randint(-5000, 5000, (n,), dtype=torch.int32, generator=g)
    return q, w, offset, torch.rand(n, generator=g) * 0.01 + 1e-4, torch.randn(n, generator=g)


AMX_SHAPES = [(9, 64, 16), (31, 64, 24), (32, 128, 32), (33, 192, 40), (64, 1024, 1024), (100, 256, 48),
              (17, 64, 1000),  # 63 blocks: an odd last block, alone; 1000 % 16 = 8
              (300, 1024, 40),  # 307K codes: tiles of 64 rows (native_amx.c), the last 12 rows zero-padded
              (40, 4096, 24),  # rows of 4 KiB: one tile of every row
              (70, 768, 96),  # inputs from 512 to 1024: the weights streamed past tiles of 32 rows
              (70, 4096, 600)]  # pairs in groups of 8 (their weights in L2: AMX_L2_WEIGHTS), the last pair half


@pytest.mark.parametrize("m,k,n", AMX_SHAPES)
def test_the_amx_gemm_gives_the_exact_sums_and_float_steps(amx, m, k, n):
    q, w, offset, w_scale, bias = _case(m, k, n)
    weight = ln.packed_weight(w)
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # past GEMM_PARALLEL_MNK the block pairs split between the threads
    try:
        for dtype, zp, low, high in FINISHES:
            got = ln.gemm_rows(q, weight, offset, 0.37, w_scale, bias, 5.5, zp, low, high, dtype)
            want = _steps(q, w, offset, 0.37, w_scale, bias, 5.5, zp, low, high, dtype)
            assert got.shape == (m, n) and torch.equal(got, want), (dtype, (got.double() - want.double()).abs().max())
        for post in ("hardswish", "tanh"):
            got = ln.gemm_rows(q, weight, offset, 1e-4, w_scale, bias, 50.0, 128, 128.0, 255.0, torch.uint8, post)
            ln.use_amx(False)
            vnni = ln.gemm_rows(q, weight, offset, 1e-4, w_scale, bias, 50.0, 128, 128.0, 255.0, torch.uint8, post)
            ln.use_amx(True)
            assert torch.equal(got, vnni) and torch.equal(got, _steps(q, w, offset, 1e-4, w_scale, bias, 50.0, 128,
                                                                       128.0, 255.0, torch.uint8, post))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bias", [True, False])
def test_the_codes_finish_gives_gemm_finish16_s_codes_at_both_bounds(amx, bias):
    # native_amx.c's amx_codes (codes out, no post-op, whole pairs) clamps as max then min: sums far past both ends
    # of the codes, and a relu's bound at the zero point, give the compare-and-select's codes
    q, w, offset, w_scale, b = _case(96, 512, 64, seed=3)
    b = b * 400 if bias else None
    weight = ln.packed_weight(w)
    for dtype, zp, low, high in [(torch.uint8, 3, 3.0, 255.0), (torch.int8, -2, -128.0, 127.0), (torch.uint8, 128, 0.0, 255.0)]:
        got = ln.gemm_rows(q, weight, offset, 0.37, w_scale, b, 5.5, zp, low, high, dtype)
        want = _steps(q, w, offset, 0.37, w_scale, b, 5.5, zp, low, high, dtype)
        assert torch.equal(got, want), (dtype, (got.double() - want.double()).abs().max())
        assert int((got == int(low)).sum()) > 100 and int((got == int(high)).sum()) > 100  # both bounds reached


@pytest.mark.parametrize("m,k,n", [(70, 128, 64), (33, 1024, 40)])  # whole pairs (amx_rows); a half pair (gemm_finish16)
@pytest.mark.parametrize("bias", [True, False])
def test_a_float_addend_is_added_where_the_amx_gemm_writes(amx, m, k, n, bias):
    q, w, offset, w_scale, b = _case(m, k, n, seed=7)
    b = b if bias else None
    weight = ln.packed_weight(w)
    addend = torch.randn(m, n, generator=torch.Generator().manual_seed(2))
    for low in (-math.inf, 0.0):
        want = _steps(q, w, offset, 0.37, w_scale, b, 0.0, 0, low, math.inf, torch.float32) + addend
        before = ln.amx_calls()
        out = torch.empty((m, n))
        assert ln.gemm_into(q, out, weight, offset, 0.37, w_scale, b, 0.0, 0, low, math.inf, torch.float32,
                            addend=addend)
        assert ln.amx_calls() == before + 1 and torch.equal(out, want), (out - want).abs().max()


def test_a_residual_is_added_where_the_amx_gemm_writes(amx):
    q, w, offset, w_scale, bias = _case(70, 128, 40)
    weight = ln.packed_weight(w)
    residual = torch.randint(0, 256, (70, 40), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    outs = []
    for on in (True, False):
        ln.use_amx(on)
        out = torch.empty((70, 40), dtype=torch.uint8)
        assert ln.gemm_into(q, out, weight, offset, 0.37, w_scale, bias, 5.5, 117, 117.0, 255.0, torch.uint8,
                            accum=residual, sum_scale=0.0411, sum_zp=121)
        outs.append(out)
    ln.use_amx(True)
    y = _steps(q, w, offset, 0.37, w_scale, bias, 0.0, 0, -math.inf, math.inf, torch.float32)
    fused = ((residual.double() - 121) * float(torch.tensor(0.0411)) + y.double()).float()
    want = (fused * torch.tensor(5.5) + torch.tensor(117.0)).clamp(117.0, 255.0).round().to(torch.uint8)
    assert torch.equal(outs[0], want) and torch.equal(outs[1], want)


def test_the_amx_gemm_takes_more_than_8_rows_of_inputs_a_multiple_of_64(amx):
    # what it does not take runs on the VNNI kernels, with the same values
    for m, k, n, tiles in [(8, 64, 16, 0), (9, 65, 16, 0), (40, 100, 32, 0), (9, 64, 16, 1), (12, 128, 16, 1)]:
        q, w, offset, w_scale, bias = _case(m, k, n, seed=5)
        weight = ln.packed_weight(w)
        before = ln.amx_calls()
        on = ln.gemm_rows(q, weight, offset, 0.37, w_scale, bias, 5.5, 3, 0.0, 255.0, torch.uint8)
        assert ln.amx_calls() - before == tiles, (m, k)
        ln.use_amx(False)
        off = ln.gemm_rows(q, weight, offset, 0.37, w_scale, bias, 5.5, 3, 0.0, 255.0, torch.uint8)
        ln.use_amx(True)
        assert ln.amx_calls() - before == tiles  # off: none
        assert torch.equal(on, off) and torch.equal(on, _steps(q, w, offset, 0.37, w_scale, bias, 5.5, 3, 0.0, 255.0,
                                                                torch.uint8))


def test_use_amx_switches_it_and_says_so(amx):
    assert ln.amx() and not ln.use_amx(False) and not ln.amx()
    assert ln.use_amx(True) and ln.amx()


def test_a_build_without_vnni_has_no_amx_gemm(native_build):
    # the builds that stand for other CPUs (conftest.py's "no VNNI", "no AVX-512") run their own kernels only
    for build in ("no VNNI", "no AVX-512", "portable"):
        native_build(build)
        assert not ln.use_amx(True) and not ln.amx()
