"""One-row linears on torch._int_mm (lucid_fx/kernels/linear_row.py): oneDNN's values bit for bit,
where batch 1 takes them; a float oracle everywhere."""

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import lucid_fx
import lucid_fx.quantization as Q
from lucid_fx.kernels import cpu, force_cpu_features, native, resolve_target
from lucid_fx.kernels.cpu_features import detected_cpu_features
from lucid_fx.kernels import linear_native as ln
from lucid_fx.kernels import linear_row as lr
from lucid_fx.kernels import pointwise_rows as pr
from lucid_fx.kernels import row_plan
from _program import lowered

ops = torch.ops.lucid_fx


# The CPU kind whose Target names each engine.
ENGINE_KIND = {"int_mm": "avx512_vnni", "native": "avx2"}


@pytest.mark.parametrize("engine", ["int_mm", "native"])
@pytest.mark.parametrize("k", [1, 13, 256])
@pytest.mark.parametrize("post_op", ["none", "relu", "hardswish"])
@pytest.mark.parametrize("out", [("uint8", 0), ("uint8", 7), ("uint8", 128), ("float32", 0)])
@pytest.mark.parametrize("x_zp", [0, 117])
def test_a_small_linear_gives_onednn_s_values_bit_for_bit(engine, k, post_op, out, x_zp, native_or_torch, monkeypatch):
    # linear_row serves small batches where oneDNN serves the others: any difference would make a
    # row's result depend on the batch around it. 2048 rows x 64 outputs, every rounding compared.
    if not cpu.onednn_available():
        pytest.skip("this torch build has no oneDNN quantized ops to compare with")
    # native_or_torch: the steps after the int32 sums in one C pass, or as torch ops
    assert native.available() == (native_or_torch == "native"), native.status()
    dtype, out_zp = getattr(torch, out[0]), out[1]
    if post_op not in lr.engine_post_ops(engine):  # hardswish on _int_mm's route (VNNI, no native GEMM): oneDNN's
        with force_cpu_features(ENGINE_KIND[engine]):
            assert lr.takes_row(resolve_target("cpu"), True, post_op, dtype, 1, 64, k) is None
        return
    g = torch.Generator().manual_seed(k + x_zp)
    qx = torch.randint(0, 256, (2048, k), dtype=torch.uint8, generator=g)
    # a grid oneDNN is exact on, VNNI or not; the full grid where its VNNI kernels run and are compared
    bound = 128 if engine == "int_mm" and lr.engine_here() == "int_mm" else 64
    qw = torch.randint(-bound, 64, (64, k), dtype=torch.int8, generator=g)
    qw[0, 0] = -bound
    ws, bias = torch.rand(64, generator=g) * 0.01 + 0.001, torch.randn(64, generator=g)
    out_scale = 0.0371
    with force_cpu_features(ENGINE_KIND[engine]):  # oneDNN's call for this kind: its linear, or its 1x1 convolution
        here = lr.row_engine(resolve_target("cpu"))
        one = cpu.linear(qx[5:6], 0.0213, x_zp, qw, ws, bias, out_scale, out_zp, post_op, dtype)
        row = lr.row_linear(qw, ws, bias, 0.0213, x_zp, None if dtype == torch.float32 else out_scale, engine, post_op)
        got = lr.linear_row(qx, row, out_zp, *lr.row_bounds(dtype, out_zp, post_op), dtype)
        # the sums from lucid_fx's GEMM (the native engine; the VNNI one where the build has VNNI), else _int_mm
        assert isinstance(row.weight, ln.PackedWeight) == (engine == "native" or ln.full_grid())
        monkeypatch.setattr(cpu, "takes_row", lambda *args: None)  # every batch on oneDNN
        want = cpu.linear(qx, 0.0213, x_zp, qw, ws, bias, out_scale, out_zp, post_op, dtype)
        one_onednn = cpu.linear(qx[5:6], 0.0213, x_zp, qw, ws, bias, out_scale, out_zp, post_op, dtype)
    assert got.dtype == dtype and got.shape == (2048, 64)
    if here is None and detected_cpu_features().amx and dtype == torch.float32:
        # oneDNN alone on an AMX CPU: up to 4 rows on its VNNI kernels, (acc * x_scale) * w_scale + bias, more on its
        # AMX ones, acc * (x_scale * w_scale) + bias: the product a float32 step apart (measured, torch 2.13)
        torch.testing.assert_close(one, want[5:6], rtol=0, atol=2 ** -22 * float(want[5:6].abs().max()))
    else:
        assert torch.equal(one, want[5:6])  # batch 1 gives the row it gives in a batch of 2048, whatever the route
    if here == engine:  # this machine's oneDNN runs the kernels whose steps the engine copies
        assert torch.equal(got, want), (got.double() - want.double()).abs().max()
    else:  # a forced kind: oneDNN's kernels here round some float32 steps otherwise; batch 1 stays on oneDNN
        assert here is None and torch.equal(one, one_onednn)
        assert float((got.double() - want.double()).abs().max()) <= (1 if dtype == torch.uint8 else 1e-5)
    y = F.linear(Q.dequantize(qx, 0.0213, x_zp), qw.float() * ws[:, None], bias)
    y = y.relu() if post_op == "relu" else ln.hardswish(y) if post_op == "hardswish" else y
    if dtype == torch.float32:
        torch.testing.assert_close(got, y, rtol=1e-5, atol=1e-4)
    else:
        assert int(((y / out_scale).round() + out_zp).clamp(0, 255).sub(got.double()).abs().max()) <= 1


@pytest.mark.parametrize("post_op", ["none", "relu"])
@pytest.mark.parametrize("out", [("uint8", 131), ("float32", 0)])
def test_a_squeeze_excite_convolution_is_a_one_row_linear_with_onednn_s_values(post_op, out, sqnr_db, monkeypatch):
    # A 1x1 convolution of a 1x1 image of batch 1 runs as linear_row (oneDNN took 60-173 us for each in the MobileNetV3-like model, profiled);
    # batch 2 runs on oneDNN's convolution, and the first image's result must not change.
    if not cpu.onednn_available():
        pytest.skip("this torch build has no oneDNN quantized ops to compare with")
    dtype, out_zp = getattr(torch, out[0]), out[1]
    g = torch.Generator().manual_seed(3)
    qx = torch.randint(0, 256, (2, 96, 1, 1), dtype=torch.uint8, generator=g).contiguous(memory_format=torch.channels_last)
    qw = torch.randint(-64, 64, (24, 96, 1, 1), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(24, generator=g) * 0.01 + 0.001, torch.randn(24, generator=g)
    assert lr.conv_is_row(qx[:1].shape, qw.shape, [0, 0], 1) and not lr.conv_is_row(qx.shape, qw.shape, [0, 0], 1)
    assert not lr.conv_is_row(qx[:1].shape, qw.shape, [1, 1], 1)  # padded: the image is no longer 1x1
    args = (0.0213, 9, qw, ws, bias, [1, 1], [0, 0], [1, 1], 1, 0.25, out_zp, post_op, dtype)
    for kind in ENGINE_KIND.values():
        with force_cpu_features(kind):
            # linear_row where it is verified against this machine's oneDNN; oneDNN for both elsewhere
            calls = []
            monkeypatch.setattr(cpu, "linear_row", lambda *a: calls.append(a) or lr.linear_row(*a))
            one, both = ops.conv2d(qx[:1], *args), ops.conv2d(qx, *args)
            # (a convolution's pixels: an AMX CPU leaves it to oneDNN here, asking it first in a program instead)
            assert len(calls) == (1 if lr.takes_row(resolve_target("cpu"), True, post_op, dtype, 1, 24, 96, True) else 0), kind
            assert torch.equal(one, both[:1]), kind
    assert one.shape == (1, 24, 1, 1) and one.dtype == dtype
    y = F.conv2d(Q.dequantize(qx[:1], 0.0213, 9), qw.float() * ws.view(-1, 1, 1, 1), bias)
    y = y.relu() if post_op == "relu" else y
    real = one if dtype == torch.float32 else Q.dequantize(one, 0.25, out_zp)
    assert sqnr_db(y, real) >= 30


@pytest.mark.parametrize("m,n,k", [(32, 128, 64), (512, 512, 512)])  # the small-linear route, and oneDNN's past it
def test_a_silu_linear_applies_torch_s_silu_after_the_float_result_at_every_size(m, n, k):
    # oneDNN's swish approximates exp, which no other route reproduces: on either row engine a SiLU linear
    # computes its float32 result (equal on both routes), then torch's SiLU and quantize_per_tensor's codes,
    # so a row gives the same codes alone and in a batch, on the small-linear route and on oneDNN.
    target = resolve_target("cpu")
    engine = lr.row_engine(target)  # its float steps are those of this CPU's oneDNN kernels: its own kind only
    if engine is None:
        pytest.skip(f"no row engine here (Target.linear_row {target.linear_row!r}, this CPU's {lr.engine_here()!r})")
    assert lr.float_post_op(resolve_target("cpu"), True, "silu", torch.uint8)
    g = torch.Generator().manual_seed(m)
    qx = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
    qw = torch.randint(-64, 64, (n, k), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(n, generator=g) * 0.01 + 0.001, torch.randn(n, generator=g)
    assert lr.small_gemm(m, n, k, engine) == (m == 32)
    got = cpu.linear(qx, 0.0213, 117, qw, ws, bias, 0.0371, 9, "silu", torch.uint8)
    y = cpu.linear(qx, 0.0213, 117, qw, ws, bias, 1.0, 0, "none", torch.float32)
    expected = Q.quantize(F.silu(y), 0.0371, 9, torch.uint8)
    assert expected.dtype == torch.uint8 and torch.equal(got, expected)
    assert torch.equal(cpu.linear(qx[3:4], 0.0213, 117, qw, ws, bias, 0.0371, 9, "silu", torch.uint8), got[3:4])


def _gemm_tanh(engine) -> bool:
    """Whether ``engine``'s GEMM computes tanh in its epilogue (lucid_fx's GEMM is built here)."""
    return engine is not None and "tanh" in lr.engine_post_ops(engine)


@pytest.mark.parametrize("post_op", ["gelu", "gelu_tanh", "tanh"])
@pytest.mark.parametrize("m,n,k", [(32, 128, 64), (512, 512, 512), (64, 1024, 1024)])  # the row engine's size, and oneDNN's
def test_a_gelu_or_tanh_linear_runs_on_the_row_engine_where_it_takes_the_size(post_op, m, n, k):
    # oneDNN's call costs more than a small linear: there the row engine's float result, then torch's op
    # (tanh: in the GEMM's epilogue where lucid_fx's GEMM is built, the next test); past it, oneDNN's fused
    # post-op (its gelu equal to torch's, its tanh within a code)
    target = resolve_target("cpu")
    engine = lr.row_engine(target)
    small = engine is not None and lr.small_gemm(m, n, k, engine, rows=lr.VNNI_FLOAT_TAIL_ROWS)
    small = small and not (post_op == "tanh" and _gemm_tanh(engine))
    assert lr.float_post_op(target, True, post_op, torch.uint8, (m, n, k)) == small
    assert not lr.float_post_op(target, True, post_op, torch.uint8)  # no size given: oneDNN's post-op
    g = torch.Generator().manual_seed(m)
    qx = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
    qw = torch.randint(-64, 64, (n, k), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(n, generator=g) * 0.01 + 0.001, torch.randn(n, generator=g)
    got = cpu.linear(qx, 0.0213, 117, qw, ws, bias, 0.0371, 9, post_op, torch.uint8)
    y = cpu.linear(qx, 0.0213, 117, qw, ws, bias, 1.0, 0, "none", torch.float32)
    act = {"gelu": F.gelu, "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "tanh": torch.tanh}[post_op]
    expected = Q.quantize(act(y), 0.0371, 9, torch.uint8)
    diff = (got.int() - expected.int()).abs()
    if small:
        assert torch.equal(got, expected)
    assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 0.002


def test_a_silu_convolution_of_one_row_applies_torch_s_silu_after_the_float_result(sqnr_db):
    # Squeeze-excite's reduction (a 1x1 convolution of a 1x1 image) is a linear of one row: as a SiLU
    # linear, it computes its float32 result, then torch's SiLU and quantize_per_tensor's codes (oneDNN's
    # fused swish took 88-114 us a call for 1152 -> 48 channels); the program does the same.
    import lucid_fx
    from torch import nn
    from lucid_fx.kernels.native import post_op_codes
    from _program import lowered

    target = resolve_target("cpu")
    if lr.row_engine(target) is None:
        pytest.skip(f"no row engine here (Target.linear_row {target.linear_row!r}, this CPU's {lr.engine_here()!r})")
    g = torch.Generator().manual_seed(0)
    qx = torch.randint(0, 256, (1, 96, 1, 1), dtype=torch.uint8, generator=g)
    qw = torch.randint(-64, 64, (24, 96, 1, 1), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(24, generator=g) * 0.01 + 0.001, torch.randn(24, generator=g)
    conv = (qx, 0.0213, 117, qw, ws, bias, [1, 1], [0, 0], [1, 1], 1)
    got = cpu._conv(*conv, 0.0371, 9, "silu", torch.uint8)
    y = cpu._conv(*conv, 1.0, 0, "none", torch.float32)
    assert got.shape == (1, 24, 1, 1) and torch.equal(got, Q.quantize(F.silu(y), 0.0371, 9, torch.uint8))
    assert torch.equal(got, post_op_codes(y.clone(), "silu", 0.0371, 9, torch.uint8))

    class Reduce(nn.Module):  # EfficientNet's squeeze-excite: pool, 1x1 reduction with SiLU, 1x1 expansion
        def __init__(self):
            super().__init__()
            self.reduce, self.expand = nn.Conv2d(96, 24, 1), nn.Conv2d(24, 96, 1)

        def forward(self, x):
            return self.expand(F.silu(self.reduce(F.adaptive_avg_pool2d(x, 1))))

    torch.manual_seed(0)
    model, x = Reduce().eval(), torch.randn(1, 96, 7, 7)
    q = lucid_fx.quantize(model, (x,), [torch.randn(1, 96, 7, 7) for _ in range(4)], progress=False)
    portable, program, calls = lowered(q, x)
    assert post_op_codes in calls and torch.ops.onednn.qconv2d_pointwise.default not in calls
    assert torch.equal(program(x), portable) and sqnr_db(model(x), portable) >= 30


def test_only_silu_into_uint8_codes_on_a_row_engine_runs_after_the_float_result():
    for kind in ("avx2", "avx512_vnni", "amx"):
        with force_cpu_features(kind):
            target = resolve_target("cpu")
            engine_here = lr.row_engine(target) is not None  # this CPU's own kind, AMX excepted
            assert lr.float_post_op(target, True, "silu", torch.uint8) == engine_here
            assert not lr.float_post_op(target, False, "silu", torch.uint8)  # oneDNN off: the exact fallbacks
            assert not any(lr.float_post_op(target, True, p, d) for p, d in [("silu", torch.int8), ("silu", torch.float32),
                                                                              ("relu", torch.uint8), ("hardswish", torch.uint8)])


@pytest.mark.parametrize("engine", ["int_mm", "native"])
@pytest.mark.parametrize("image", [(2, 24, 5, 7), (3, 24, 1, 1)], ids=["5x7 image", "1x1 image"])
@pytest.mark.parametrize("out", [("uint8", 9), ("float32", 0)])
def test_pointwise_rows_are_the_linear_of_each_pixel_in_the_image_s_layout(engine, image, out, native_or_torch):
    # A 1x1 convolution's pixels as rows: read in place on lucid_fx's GEMM, written into a channels-last
    # result (contiguous for a 1x1 image, as a linear's result viewed so); the same values as
    # linear_row on the pixels laid out as rows, and the views' route (non-channels-last codes, _int_mm).
    dtype, out_zp = getattr(torch, out[0]), out[1]
    g = torch.Generator().manual_seed(3)
    n, c, h, w = image
    q = torch.randint(0, 256, image, dtype=torch.uint8, generator=g).contiguous(memory_format=torch.channels_last)
    qw = torch.randint(-64, 64, (40, c), dtype=torch.int8, generator=g)
    with force_cpu_features(ENGINE_KIND[engine]):
        row = lr.row_linear(qw, torch.rand(40, generator=g) * 0.01, torch.randn(40, generator=g), 0.02, 117,
                            None if dtype == torch.float32 else 0.05, engine)
    bounds = lr.row_bounds(dtype, out_zp, "none")
    want = lr.linear_row(q.permute(0, 2, 3, 1).reshape(-1, c), row, out_zp, *bounds, dtype).view(n, h, w, 40)
    for codes in (q, q.contiguous()):  # the second: not channels-last, the views' route
        got = pr.pointwise_rows(codes, row, out_zp, *bounds, dtype)
        assert got.shape == (n, 40, h, w) and got.dtype == dtype
        assert torch.equal(got.permute(0, 2, 3, 1), want)
        layout = torch.channels_last if h * w > 1 else torch.contiguous_format
        assert got.is_contiguous(memory_format=layout)
        if h * w == 1:
            assert got.stride() == (40, 1, 1, 1)  # the strides of a (N, 40) result viewed (N, 40, 1, 1)


def _residual_check(engine: str, post_op: str) -> None:
    """lucid_fx's GEMM on ``engine`` adds a residual as this process's oneDNN 1x1 convolution with its
    "sum" post-op does, fma(r - r_zp, r_scale, y): the codes bit for bit (1.5M outputs, scales not
    powers of two, so the float steps' order shows), into a new tensor, the residual untouched."""
    g = torch.Generator().manual_seed(5)
    x = torch.randint(0, 256, (1, 24, 160, 160), dtype=torch.uint8, generator=g).contiguous(memory_format=torch.channels_last)
    other = torch.randint(0, 256, (1, 60, 160, 160), dtype=torch.uint8, generator=g)
    other = other.contiguous(memory_format=torch.channels_last)
    kept = other.clone()
    bound = 128 if engine == "int_mm" else ln.PAIR_SAFE  # the engine's grid
    qw = torch.randint(-bound, bound, (60, 24, 1, 1), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(60, generator=g) * 0.01 + 0.001, torch.randn(60, generator=g)
    want = cpu.conv2d_add(x, 0.0173, 7, qw, ws, bias, [1, 1], [0, 0], [1, 1], 1, other, 0.0411, 121, 0.0297, 117,
                          post_op, None)
    row = lr.row_linear(qw, ws, bias, 0.0173, 7, 0.0297, engine, post_op)
    got = pr.pointwise_rows_sum(x, row, other, 0.0411, 121, 117, *lr.row_bounds(torch.uint8, 117, post_op))
    assert got.is_contiguous(memory_format=torch.channels_last) and torch.equal(other, kept)
    assert torch.equal(got, want), f"{engine}: {int((got != want).sum())} codes differ"
    # the sum's rounding shows: adding the residual after a separate product would give other codes
    y = pr.pointwise_rows(x, lr.row_linear(qw, ws, bias, 0.0173, 7, None, engine), 0, -math.inf, math.inf,
                          torch.float32)
    r = (other.to(torch.int32) - 121).to(torch.float32) * torch.tensor(0.0411)
    unfused = ((y + r) * (torch.tensor(1.0) / torch.tensor(0.0297)) + 117).clamp(117 if post_op == "relu" else 0, 255)
    assert int((unfused.round().to(torch.uint8) != want).sum()) > 0


@pytest.mark.parametrize("post_op", ["none", "relu"])
def test_a_pointwise_convolution_plus_a_residual_gives_onednn_s_sum_codes(post_op):
    # On this CPU's engine: VNNI's (lucid_fx's GEMM built with VNNI's steps) or AVX2's.
    engine = lr.engine_here()
    if engine is None or (engine == "int_mm" and not ln.full_grid()) or not ln.sum_available():
        pytest.skip(f"needs lucid_fx's GEMM as this CPU's own engine (engine here {engine}, VNNI GEMM {ln.full_grid()})")
    _residual_check(engine, post_op)


def test_the_residual_on_the_avx2_engine_gives_onednn_s_avx2_sum_codes():
    # On a CPU past AVX2, oneDNN capped at AVX2 (read once, at its start: a process of its own) runs
    # an AVX2 CPU's kernels, and the native engine (AVX2's order of the float steps) matches them.
    if lr.engine_here() != "int_mm":
        pytest.skip(f"this CPU's own engine is {lr.engine_here()}: the test above compares it")
    if not ln.sum_available():
        pytest.skip(f"needs lucid_fx's native kernels: {native.status()}")
    env = {**os.environ, "ONEDNN_MAX_CPU_ISA": "AVX2", "LUCID_FX_CPU_ISA": "avx2", "OMP_NUM_THREADS": "1"}
    code = ("import sys; sys.path[:0] = sys.argv[1:]; import test_linear_row as t, lucid_fx.kernels.linear_row as lr; "
            "assert lr.engine_here() == 'native', lr.engine_here(); t._residual_check('native', 'none'); "
            "t._residual_check('native', 'relu'); print('checked')")
    here = Path(__file__).parent  # the test's own folder, and tests/ (its helpers)
    done = subprocess.run([sys.executable, "-c", code, str(here), str(here.parent)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "checked" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("engine", ["int_mm", "native"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_linear_rows_are_the_linear_of_the_last_dim_of_any_rank(engine, layout, native_or_torch):
    # A transformer's (batch, seq, K) codes: read in place on lucid_fx's GEMM, the (batch, seq, N)
    # result written directly; a strided input takes the reshape's route. The values of linear_row
    # on the rows laid out as a matrix.
    g = torch.Generator().manual_seed(4)
    q = torch.randint(0, 256, (3, 7, 24), dtype=torch.uint8, generator=g)
    q = q if layout == "contiguous" else q.transpose(0, 1).contiguous().transpose(0, 1)
    qw = torch.randint(-64, 64, (40, 24), dtype=torch.int8, generator=g)
    with force_cpu_features(ENGINE_KIND[engine]):
        row = lr.row_linear(qw, torch.rand(40, generator=g) * 0.01, torch.randn(40, generator=g), 0.02, 117, 0.05,
                            engine)
    got = lr.linear_rows(q, row, 9, 0, 255, torch.uint8)
    want = lr.linear_row(q.reshape(-1, 24), row, 9, 0, 255, torch.uint8).view(3, 7, 40)
    assert got.shape == (3, 7, 40) and got.is_contiguous() and torch.equal(got, want)
    assert torch.equal(lr.linear_rows(q[0, 0], row, 9, 0, 255, torch.uint8), want[0, 0])  # one row of rank 1


def test_a_program_s_small_linear_of_rank_3_is_one_call():
    # (2, 5, 16) codes into a small linear: the row engine's call, without a reshape before it and a
    # view after, where this CPU's kind has a row engine here; oneDNN's linear otherwise.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.ReLU(), torch.nn.Linear(24, 8)).eval()
    x = torch.randn(2, 5, 16)
    q = lucid_fx.quantize(model, (x,), [x, torch.randn_like(x), 2 * torch.randn_like(x)])
    portable, program, calls = lowered(q, x)
    assert torch.equal(program(x), portable)
    methods = [n.target for n in program.graph.nodes if n.op == "call_method"]
    target, on = resolve_target("cpu"), cpu._onednn_on()
    rows = [lr.takes_row(target, on, "relu", torch.uint8, 10, 24, 16), lr.takes_row(target, on, "none", torch.float32,
                                                                                       10, 8, 24)]
    assert calls.count(row_plan.planned_rows) == sum(engine is not None for engine in rows)
    if all(rows):
        assert "reshape" not in methods and "view" not in methods


def test_a_residual_call_on_inputs_its_program_was_not_built_for_says_so():
    # pointwise_rows_sum runs only where the program found lucid_fx's GEMM and channels-last codes: other
    # inputs (here contiguous codes, and a weight on _int_mm's route) are refused with a message, not run.
    g = torch.Generator().manual_seed(6)
    q = torch.randint(0, 256, (1, 8, 3, 5), dtype=torch.uint8, generator=g)
    other = torch.randint(0, 256, (1, 16, 3, 5), dtype=torch.uint8, generator=g).contiguous(memory_format=torch.channels_last)
    qw = torch.randint(-64, 64, (16, 8), dtype=torch.int8, generator=g)
    with force_cpu_features("avx512_vnni"):
        row = lr.row_linear(qw, torch.rand(16, generator=g) * 0.01, None, 0.02, 3, 0.05, "int_mm")
    for codes in (q, q.contiguous(memory_format=torch.channels_last)):
        if codes.is_contiguous(memory_format=torch.channels_last) and isinstance(row.weight, ln.PackedWeight) \
                and ln.sum_available():
            continue  # what the program builds: covered by the tests above
        with pytest.raises(RuntimeError, match="1x1 convolution with a residual met inputs other than those"):
            pr.pointwise_rows_sum(codes, row, other, 0.05, 120, 117, 0, 255)


@pytest.mark.parametrize("m,n,k", [(1, 128, 64), (32, 128, 64), (64, 1024, 1024), (512, 512, 512)])
def test_a_tanh_linear_on_the_row_engine_computes_tanh_in_the_gemm(m, n, k):
    # Where lucid_fx's GEMM takes the linear, it computes tanh in its epilogue (linear_native.tanh_steps, within
    # 4 ulp of tanh): no float pass after it, no oneDNN call. The gated MLP's merged 64 x 1024 -> 2048 tanh
    # linear runs so. Past its sizes, oneDNN's fused tanh (within a code of torch's).
    target = resolve_target("cpu")
    engine = lr.row_engine(target, m)
    within = target.row_limit is None  # AMX: relu or none on a few rows only (onednn_steps.py)
    in_gemm = _gemm_tanh(engine) and lr.small_gemm(m, n, k, engine) and within
    assert lr.takes_row(target, True, "tanh", torch.float32, m, n, k) == (engine if in_gemm else None)
    assert not (in_gemm and lr.float_post_op(target, True, "tanh", torch.float32, (m, n, k)))
    g = torch.Generator().manual_seed(m + n)
    qx = torch.randint(0, 256, (m, k), dtype=torch.uint8, generator=g)
    qw = torch.randint(-64, 64, (n, k), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(n, generator=g) * 0.004 / math.sqrt(k) + 1e-5, torch.randn(n, generator=g)
    got = cpu.linear(qx, 0.0213, 117, qw, ws, bias, 1.0, 0, "tanh", torch.float32)
    y = cpu.linear(qx, 0.0213, 117, qw, ws, bias, 1.0, 0, "none", torch.float32)
    assert 0.3 < float(y.std()) < 3  # both of the tanh's branches (below and above 0.625)
    if in_gemm:
        assert torch.equal(got, ln.tanh_steps(y))
    assert float((got - torch.tanh(y)).abs().max()) <= 2e-6
    codes = cpu.linear(qx, 0.0213, 117, qw, ws, bias, 0.0079, 128, "tanh", torch.uint8)
    assert int((codes.int() - Q.quantize(torch.tanh(y), 0.0079, 128, torch.uint8).int()).abs().max()) <= 1


def test_at_one_thread_the_vnni_engine_takes_64_rows_but_a_float_tail_only_16(monkeypatch):
    # the 8-row AVX-512 GEMM beat oneDNN up to 64 x 1024 x 1024; a tanh or gelu run as a float pass after it did not
    monkeypatch.setattr(ln, "full_grid", lambda: True)
    monkeypatch.setattr(lr, "row_engine", lambda target, rows=None: "int_mm")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        target = dataclasses.replace(resolve_target("cpu"), row_limit=None)  # an AMX CPU's cap aside (the next test)
        assert lr.takes_row(target, True, "relu", torch.uint8, 64, 1024, 1024) == "int_mm"
        assert lr.takes_row(target, True, "relu", torch.uint8, 65, 1024, 1024) is None
        for post_op in ("gelu", "gelu_tanh"):
            assert lr.float_post_op(target, True, post_op, torch.uint8, (16, 1024, 1024))
            assert not lr.float_post_op(target, True, post_op, torch.uint8, (64, 1024, 1024))
        # tanh in the GEMM's epilogue, at any size the GEMM takes
        assert lr.takes_row(target, True, "tanh", torch.float32, 64, 2048, 1024) == "int_mm"
        assert not lr.float_post_op(target, True, "tanh", torch.uint8, (16, 1024, 1024))
        assert lr.takes_row(target, True, "tanh", torch.float32, 65, 1024, 1024) is None
    finally:
        torch.set_num_threads(before)


def _amx_target(monkeypatch, tiles: bool):
    """An AMX CPU's target, its oneDNN's steps known (row_engine), lucid_fx's AMX GEMM on or off (or not built)."""
    monkeypatch.setattr(lr, "row_engine", lambda target, rows=None: "int_mm")
    monkeypatch.setattr(lr.linear_native, "amx", lambda: tiles)
    with force_cpu_features("amx"):
        return resolve_target("cpu")


@pytest.mark.parametrize("post_op", ["none", "relu"])
def test_on_an_amx_cpu_the_row_engine_takes_a_few_rows_only(post_op, monkeypatch):
    # where its oneDNN picks VNNI or AMX kernels by shape, the engine takes up to 4 rows, relu or none, with the steps
    # oneDNN takes for the shape (onednn_steps.py); with lucid_fx's AMX GEMM off
    target = _amx_target(monkeypatch, False)
    assert (target.linear_row, target.row_limit) == ("int_mm", 4)
    assert [lr.takes_row(target, True, post_op, torch.uint8, m, 64, 64) for m in (1, 4, 5, 64)] == ["int_mm"] * 2 + [None] * 2


@pytest.mark.parametrize("post_op", ["none", "relu"])
def test_with_the_amx_gemm_on_the_row_engine_takes_any_rows_of_inputs_a_multiple_of_64(post_op, monkeypatch):
    # row_sizes.amx_gemm: up to 8 rows of any inputs (its VNNI kernels), any number of a multiple of 64 (its tiles)
    target = _amx_target(monkeypatch, True)
    takes = [lr.takes_row(target, True, post_op, torch.uint8, m, 1024, k) for m, k in
             [(1, 1000), (8, 1000), (9, 1000), (9, 1024), (64, 1024), (256, 64), (257, 1024), (4096, 1024), (4096, 1000)]]
    assert takes == ["int_mm", "int_mm", None, "int_mm", "int_mm", "int_mm", "int_mm", "int_mm", None]
    assert lr.takes_row(target, True, "hardswish", torch.uint8, 64, 1024, 1024) is None  # oneDNN's post-op
    assert lr.takes_row(target, True, post_op, torch.uint8, 64, 1024, 1024, pointwise=True) is None


@pytest.mark.parametrize("m", [1, 2, 3, 4])
@pytest.mark.parametrize("out", [("uint8", 7), ("float32", 0)])
def test_on_an_amx_cpu_few_rows_give_onednn_s_values_bit_for_bit(m, out, monkeypatch):
    # The first test of this file compares the engine with a batch of 2048 on oneDNN, which an AMX CPU runs on its AMX
    # kernels; here the few rows the engine takes there, with the steps oneDNN takes for each shape (256 outputs of
    # 1024 inputs: VNNI's at one row, AMX's at two to four, measured).
    if lr.few_rows_engine_here() is None:
        pytest.skip(f"needs an AMX CPU running oneDNN's AMX kernels (this one: {detected_cpu_features().name})")
    dtype, out_zp = getattr(torch, out[0]), out[1]
    g = torch.Generator().manual_seed(m)
    qx = torch.randint(0, 256, (m, 1024), dtype=torch.uint8, generator=g)
    qw = torch.randint(-128, 128, (256, 1024), dtype=torch.int8, generator=g)
    ws, bias = torch.rand(256, generator=g) * 0.001 + 0.0002, torch.randn(256, generator=g)
    args = (qx, 0.0213, 117, qw, ws, bias, 0.37, out_zp, "relu", dtype)
    target = resolve_target("cpu")
    assert lr.takes_row(target, True, "relu", dtype, m, 256, 1024) == "int_mm"
    got = cpu.linear(*args)
    monkeypatch.setattr(cpu, "takes_row", lambda *a: None)  # oneDNN's own call
    want = cpu.linear(*args)
    assert torch.equal(got, want), (got.double() - want.double()).abs().max()
