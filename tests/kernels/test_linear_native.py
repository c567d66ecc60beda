"""lucid_fx/kernels/linear_native.py and native_gemm.c: exact int32 sums of uint8 codes and 7-bit
weights, then the float steps one float32 rounding at a time, with the AVX2 path and without it."""

import math
from pathlib import Path

import pytest
import torch

from lucid_fx.kernels import linear_native as ln
from lucid_fx.kernels import linear_row as lr
from lucid_fx.kernels import native
from lucid_fx.kernels.native_build import AVX2_CAP

f32 = lambda v: torch.tensor(v, dtype=torch.float32)  # noqa: E731


def _steps(q, w, offset, x_scale, w_scale, bias, inv_out, zp, low, high, dtype, post="none"):
    """The oracle: int64 sums, then each float32 step as the C comment gives it."""
    acc = (q.to(torch.int64) @ w.to(torch.int64).T + offset).to(torch.float32)
    y = acc * f32(x_scale) * w_scale
    y = y if bias is None else y + bias
    y = ln.hardswish(y) if post == "hardswish" else ln.tanh_steps(y) if post == "tanh" else y
    if dtype == torch.float32:
        return y.clamp(low, high)
    return (y * f32(inv_out) + f32(float(zp))).clamp(low, high).round().to(dtype)


SHAPES = [(1, 1, 1), (1, 1024, 1024), (3, 13, 17), (4, 64, 16), (5, 7, 33), (9, 260, 48), (16, 64, 64),
          (7, 20, 24), (2, 9, 41),  # a block of 8 and 9 outputs past the full ones: a vector of 8 and a tail
          (12, 13, 40), (24, 37, 33), (8, 4, 16),  # AVX-512's 8 rows by 2 blocks: an odd last block, k % 4, rows left
          (10, 300, 40), (11, 257, 33),  # 8 rows on AVX-512, then 2 or 3 (one pass, two sets of sums), k % 4
          (9, 1024, 520), (64, 300, 260)]  # past GEMM_PARALLEL_MNK: the block pairs split among 2 threads, an odd last one
FINISHES = [(torch.uint8, 3, 0.0, 255.0), (torch.uint8, 128, 128.0, 255.0), (torch.int8, -2, -128.0, 127.0),
            (torch.float32, 0, -math.inf, math.inf), (torch.float32, 0, 0.0, math.inf)]


def _cpu_flags() -> set:
    return set(Path("/proc/cpuinfo").read_text().split()) if Path("/proc/cpuinfo").exists() else set()


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "no AVX-512", "portable", "no OpenMP"])
@pytest.mark.parametrize("m,k,n", SHAPES)
def test_the_gemm_equals_exact_sums_and_the_float_steps(native_build, build, m, k, n):
    # "this CPU": -march=native (4 rows by 16 outputs per block, with AVX-512's VNNI 8 rows by 32; tails in every dimension; VNNI's steps
    # where the CPU has them, exact for every int8 weight; float steps 16 at a time with AVX-512);
    # "no VNNI": the AVX2 steps, exact for 7-bit weights; "no AVX-512": those with the float steps 8
    # at a time; "portable": the plain loop alone; "no OpenMP": this CPU's, the columns on one thread. The test
    # runs at 2 threads: with OpenMP, products past GEMM_PARALLEL_MNK split their columns between them.
    native_build(build)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _gemm_case(build, m, k, n)
    finally:
        torch.set_num_threads(before)


def _gemm_case(build, m, k, n):
    flags = _cpu_flags()
    assert ln.threaded() == ("-fopenmp" in native.status())
    if build == "portable":
        assert not ln.available() and not ln.full_grid()
    elif flags and "-march=native" in native.status():
        assert ln.available() == ("avx2" in flags)
        vnni = "avx_vnni" in flags or {"avx512_vnni", "avx512vl"} <= flags
        capped = " ".join(AVX2_CAP) in native.status()  # ONEDNN_MAX_CPU_ISA=AVX2: an AVX2 CPU's build
        assert ln.full_grid() == (build in ("this CPU", "no OpenMP") and vnni and not capped)
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    q = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
    bound = 128 if ln.full_grid() else ln.PAIR_SAFE  # the grid this build's sums are exact on
    w = torch.randint(-bound, min(bound + 1, 128), (n, k), dtype=torch.int8, generator=g)
    w[0, :4] = -bound  # the widest sums: 255 * -64 in AVX2's int16 pairs, 255 * -128 in VNNI's int32
    q[0, :4] = 255
    weight = ln.packed_weight(w)
    offset = torch.randint(-5000, 5000, (n,), dtype=torch.int32, generator=g)
    w_scale, bias = torch.rand(n, generator=g) * 0.01 + 1e-4, torch.randn(n, generator=g)
    for dtype, zp, low, high in FINISHES:
        for b in (bias, None):
            got = ln.gemm_rows(q, weight, offset, 0.37, w_scale, b, 5.5, zp, low, high, dtype)
            want = _steps(q, w, offset, 0.37, w_scale, b, 5.5, zp, low, high, dtype)
            assert got.dtype == dtype and got.shape == (m, n)
            assert torch.equal(got, want), (dtype, (got.double() - want.double()).abs().max())
    # the post-ops in the epilogue, on sums scaled to about 1 (where tanh is not yet +-1): the same steps
    # scalar, 8 lanes and 16 (every build, every tail), as the torch steps give them
    x_scale = 0.37 / max(float(ln.gemm_rows(q, weight, offset, 0.37, w_scale, None, 0.0, 0, -math.inf, math.inf,
                                            torch.float32).std()), 1e-3) if m * n > 1 else 1e-4
    for post in ("hardswish", "tanh"):
        for dtype, zp, low, high in (FINISHES[1], FINISHES[3]):
            got = ln.gemm_rows(q, weight, offset, x_scale, w_scale, bias, 50.0, zp, low, high, dtype, post)
            want = _steps(q, w, offset, x_scale, w_scale, bias, 50.0, zp, low, high, dtype, post)
            assert torch.equal(got, want), (post, dtype, (got.double() - want.double()).abs().max())


def _safe_case(m, k, n):
    """(generator, codes, weight, its packed copy, offsets, scales, bias) of an m x k by k x n product whose int16 pair
    sums are exact on every build (|w| <= PAIR_SAFE)."""
    g = torch.Generator().manual_seed(m + k + n)
    q = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
    w = torch.randint(-ln.PAIR_SAFE, ln.PAIR_SAFE, (n, k), dtype=torch.int8, generator=g)
    offset = torch.randint(-5000, 5000, (n,), dtype=torch.int32, generator=g)
    w_scale, bias = torch.rand(n, generator=g) * 0.01 + 1e-4, torch.randn(n, generator=g)
    return g, q, w, ln.packed_weight(w), offset, w_scale, bias


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "no AVX-512", "portable"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 20, 24), (9, 260, 48), (20000, 1, 100), (200000, 1, 7)])
def test_a_residual_is_added_as_one_fused_multiply_add_on_every_build(native_build, build, m, k, n):
    # oneDNN's "sum" post-op: y + (r - r_zp) * r_scale rounded once (fmaf; FMA3 8 lanes, AVX-512 16),
    # before the output's scale: the oracle's fused step is a float64 sum, exact here, rounded once.
    # The two big cases (2M and 1.4M outputs, vectors with a tail and a tail alone) are where a
    # product rounded before the sum gives another code somewhere.
    native_build(build)
    g, q, w, weight, offset, w_scale, bias = _safe_case(m, k, n)
    residual = torch.randint(0, 256, (m, n), dtype=torch.uint8, generator=g)
    y = _steps(q, w, offset, 0.37, w_scale, bias, 0.0, 0, -math.inf, math.inf, torch.float32)
    fused = ((residual.double() - 121) * float(f32(0.0411)) + y.double()).float()
    for zp, low in ((117, 0.0), (117, 117.0)):  # none, relu
        want = (fused * f32(5.5) + f32(float(zp))).clamp(low, 255.0).round().to(torch.uint8)
        out = torch.empty((m, n), dtype=torch.uint8)
        assert ln.gemm_into(q, out, weight, offset, 0.37, w_scale, bias, 5.5, zp, low, 255.0, torch.uint8,
                            accum=residual, sum_scale=0.0411, sum_zp=121)
        assert torch.equal(out, want), int((out != want).sum())


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "no AVX-512", "portable"])
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 20, 24), (9, 260, 48), (70, 128, 100), (2000, 3, 37)])
@pytest.mark.parametrize("bias", [True, False])
def test_a_float_addend_is_added_after_the_float_steps_on_every_build(native_build, build, m, k, n, bias):
    # oneDNN's binary "add" (a residual connection): the float32 result, clamped, plus the addend: torch.add's sum
    native_build(build)
    g, q, w, weight, offset, w_scale, b = _safe_case(m, k, n)
    b = b if bias else None
    addend = torch.randn(m, n, generator=g)
    for low in (-math.inf, 0.0):  # none, relu
        want = _steps(q, w, offset, 0.37, w_scale, b, 0.0, 0, low, math.inf, torch.float32) + addend
        out = torch.empty((m, n))
        assert ln.gemm_into(q, out, weight, offset, 0.37, w_scale, b, 0.0, 0, low, math.inf, torch.float32,
                            addend=addend)
        assert torch.equal(out, want), (out - want).abs().max()


def test_without_the_native_kernels_torch_computes_the_same_values(native_env):
    native_env()
    g = torch.Generator().manual_seed(1)
    q = torch.randint(0, 256, (6, 37), dtype=torch.uint8, generator=g)
    w = torch.randint(-64, 65, (21, 37), dtype=torch.int8, generator=g)
    weight, offset = ln.packed_weight(w), torch.randint(-99, 99, (21,), dtype=torch.int32, generator=g)
    args = (offset, 1.0, torch.rand(21, generator=g), torch.randn(21, generator=g), 3.0, 7, 0.0, 255.0, torch.uint8)
    compiled, tanh = ln.gemm_rows(q, weight, *args), ln.gemm_rows(q, weight, *args, "tanh")
    native_env(LUCID_FX_NATIVE="0")
    assert torch.equal(ln.gemm_rows(q, weight, *args), compiled)
    assert torch.equal(ln.gemm_rows(q, weight, *args, "tanh"), tanh)
    assert torch.equal(compiled, _steps(q, w, *args)) and torch.equal(tanh, _steps(q, w, *args, "tanh"))
    assert not torch.equal(tanh, compiled)


def test_the_gemm_s_tanh_is_within_4_ulp_of_the_exact_value():
    # Eigen's rational tanh in float32 steps (native_gemm.h): against float64's tanh every 6e-6 over [-12, 12]
    # and on a log scale down to 1e-8 (where it is y itself), both signs; +-1 past the clamp, never past it.
    y = torch.cat([torch.linspace(-12, 12, 4000001), torch.logspace(-8, 1, 20001), -torch.logspace(-8, 1, 20001)])
    exact = torch.tanh(y.double())
    got = ln.tanh_steps(y)
    ulp = (got.double() - exact).abs() / exact.abs().clamp_min(1e-30) / 2.0 ** -23  # 0 gives 0
    assert float(ulp.max()) <= 4.0, float(ulp.max())
    assert float((got.double() - exact).abs().max()) < 5e-7 and float(got.abs().max()) <= 1.0
    edge = torch.tensor([0.0, -0.0, 1e-5, 0.625, -0.625, 9.5, -9.5, 40.0, -1e30, 1e30])
    assert ln.tanh_steps(edge).tolist() == pytest.approx([0.0, 0.0, 1e-5, 0.5546, -0.5546, 1.0, -1.0, 1.0, -1.0, 1.0],
                                                         abs=1e-4)


def test_the_packed_weight_is_a_copy_in_blocks_of_16_outputs_by_4_inputs():
    w = torch.arange(-40, 40, dtype=torch.int8).view(20, 4)[:, :3]  # a strided weight: 20 outputs, 3 inputs
    weight = ln.packed_weight(w)
    assert weight.packed.shape == (2, 1, 16, 4) and (weight.n, weight.k) == (20, 3)
    assert weight.packed[0, 0, 5].tolist() == [*w[5].tolist(), 0]  # output 5, inputs 0-2, then a zero pad
    assert weight.packed[1, 0, 3].tolist() == [*w[19].tolist(), 0] and not weight.packed[1, 0, 4:].any()
    assert weight.row_sums.tolist() == w.sum(1).tolist()
    w[0, 0] = 9
    assert weight.packed[0, 0, 0, 0] == -40  # the weight's later edits do not reach the pack


@pytest.mark.parametrize("build", ["no VNNI", "this CPU"])
def test_a_weight_past_the_exact_pair_sums_is_left_to_onednn_without_vnni(native_build, build):
    # Without VNNI, codes past +-64 could saturate the int16 pair sums: the native engine declines,
    # oneDNN serves. VNNI's steps sum in int32: a build with them takes every weight.
    native_build(build)
    ws = torch.full((8,), 0.01)
    ok = torch.randint(-64, 65, (8, 16), dtype=torch.int8)
    wide = ok.clone()
    wide[3, 7] = -128
    assert ln.takes_weight(ok) and ln.takes_weight(wide) == ln.full_grid()
    assert build == "this CPU" or not ln.full_grid()
    assert lr.row_linear(ok, ws, None, 0.1, 0, 0.2, "native") is not None
    assert (lr.row_linear(wide, ws, None, 0.1, 0, 0.2, "native") is None) == (not ln.full_grid())


def test_the_vnni_engine_takes_any_linear_of_few_rows_on_the_vnni_gemm(monkeypatch):
    # With _int_mm, several rows only while the weight is small; the VNNI GEMM serves any of up to
    # VNNI_GEMM_ROWS rows at one thread (VNNI_THREADED_ROWS at more, where its GEMM runs on them), any of up
    # to SMALL_GEMM_MNK multiply-adds, and a 1x1 convolution's of up to VNNI_POINTWISE_ROWS pixels at one thread.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        monkeypatch.setattr(ln, "full_grid", lambda: False)
        assert lr.small_gemm(1, 4096, 4096) and not lr.small_gemm(8, 1024, 1024) and lr.small_gemm(64, 64, 64)
        monkeypatch.setattr(ln, "full_grid", lambda: True)
        assert lr.small_gemm(64, 4096, 1024) and not lr.small_gemm(65, 1024, 1024)
        assert lr.small_gemm(1024, 64, 64) and not lr.small_gemm(1024, 64, 256)  # 2^22, then 2^24 multiply-adds
        # a 1x1 convolution's GEMM: any size up to VNNI_POINTWISE_ROWS pixels (oneDNN's convolution was slower)
        assert lr.small_gemm(196, 672, 112, pointwise=True) and not lr.small_gemm(196, 672, 112)
        assert lr.small_gemm(1024, 1024, 1024, pointwise=True) and not lr.small_gemm(1025, 64, 256, pointwise=True)
        torch.set_num_threads(2)  # the GEMM on torch's threads: up to VNNI_THREADED_ROWS rows
        monkeypatch.setattr(ln, "threaded", lambda: True)
        assert lr.small_gemm(64, 4096, 4096) and not lr.small_gemm(65, 4096, 4096)
        assert lr.small_gemm(16, 1024, 1024, rows=lr.VNNI_FLOAT_TAIL_ROWS) and not lr.small_gemm(17, 1024, 1024, rows=16)
        assert not lr.small_gemm(196, 672, 112, pointwise=True)
        monkeypatch.setattr(ln, "threaded", lambda: False)  # a build without OpenMP: oneDNN's threads past a row
        assert lr.small_gemm(1, 4096, 4096) and not lr.small_gemm(2, 4096, 4096)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("threaded", [True, False])
def test_the_native_engine_takes_the_linears_it_was_measured_faster_on(monkeypatch, threads, threaded):
    monkeypatch.setattr(ln, "threaded", lambda: threaded)  # the GEMM on torch's threads, or (no OpenMP) one
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert lr.small_gemm(16, 64, 64, "native") and lr.small_gemm(1, 4096, 4096, "native")
        assert lr.small_gemm(64, 1024, 1024, "native") == (threads == 1 or threaded)  # 2^26 multiply-adds
        assert not lr.small_gemm(1024, 1024, 1024, "native")  # 2^30: oneDNN was faster
        assert not lr.small_gemm(1, 64, 64, None)
    finally:
        torch.set_num_threads(before)
