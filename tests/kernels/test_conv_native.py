"""lucid_fx/kernels/conv_native.py and native_conv.c: dense and depthwise int8 convolutions with
oneDNN's values bit for bit where this machine's oneDNN runs its AVX2 kernels, and the exact sums
and float steps of the torch path everywhere, with the AVX2 path and without it."""

import unittest.mock

import pytest
import torch
import torch.nn as nn

import lucid_fx
from lucid_fx.kernels import conv_native as cn
from lucid_fx.kernels import cpu, force_cpu_features, resolve_target
from lucid_fx.kernels import linear_native as ln
from lucid_fx.kernels import linear_row as lr
from lucid_fx.kernels import native
from lucid_fx.kernels import pointwise_rows as pr
from lucid_fx.program import programs_of
from _program import called, lowered, operands

# (n, c, h, w, cout, kernel, stride, padding, groups): dense with channel tails of 4 and output
# tails of 16, depthwise in steps of 32 (AVX-512), 16 and 8 channels and tails of each, strides, 1x1, 5x5.
CASES = [(1, 16, 8, 8, 16, 3, 1, 1, 1), (2, 12, 9, 7, 20, 3, 2, 1, 1), (1, 8, 5, 5, 33, 1, 1, 0, 1),
         (2, 24, 9, 9, 24, 3, 1, 1, 24), (1, 40, 7, 7, 40, 5, 2, 2, 40), (1, 9, 6, 6, 9, 3, 1, 1, 9),
         (1, 72, 6, 6, 72, 3, 1, 1, 72), (2, 49, 5, 5, 49, 5, 1, 2, 49)]
FINISHES = [(torch.uint8, 7, "none"), (torch.uint8, 100, "relu"), (torch.uint8, 30, "hardswish"),
            (torch.float32, 0, "none"), (torch.float32, 0, "relu"), (torch.float32, 0, "hardswish")]


def _case(n, c, h, w, cout, k, groups, x_zp):
    g = torch.Generator().manual_seed(c * h + cout + x_zp)
    x = torch.randint(0, 256, (n, c, h, w), dtype=torch.uint8, generator=g).contiguous(memory_format=torch.channels_last)
    # The grid the kernels are exact on: the full grid for depthwise (Target.layer_weight_range) and, in a
    # build with VNNI's steps, for dense; [-64, 63] for dense without them
    low = -128 if groups > 1 or ln.full_grid() else -64
    qw = torch.randint(low, -low, (cout, c // groups, k, k), dtype=torch.int8, generator=g)
    return x, qw, torch.rand(cout, generator=g) * 0.01 + 0.001, torch.randn(cout, generator=g)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("x_zp", [0, 3, 128])
def test_the_native_convolution_gives_onednn_s_values_bit_for_bit(case, x_zp, native_on):
    if not cpu.onednn_available():
        pytest.skip("this torch build has no oneDNN quantized ops to compare with")
    n, c, h, w, cout, k, s, p, groups = case
    x, qw, ws, bias = _case(n, c, h, w, cout, k, groups, x_zp)
    here = lr.engine_here()  # whose float steps this machine's oneDNN takes: its AVX2 kernels', or VNNI's
    for dtype, out_zp, post_op in FINISHES:
        conv = cn.native_conv(qw, ws, bias, 0.0213, x_zp, [p, p], groups, lr.row_out_scale(0.37, dtype), post_op,
                              here or "native")
        got = cn.conv_codes(x, conv, [s, s], [p, p], [1, 1], x_zp, out_zp, *lr.row_bounds(dtype, out_zp, post_op), dtype)
        with force_cpu_features("avx2"):  # oneDNN's convolution, as the program would call it without the kernel
            want = cpu._conv(x, 0.0213, x_zp, qw, ws, bias, [s, s], [p, p], [1, 1], groups, 0.37, out_zp, post_op, dtype)
        assert got.shape == want.shape and got.is_contiguous(memory_format=torch.channels_last)
        if here in ("native", "int_mm"):  # the steps these copy, on their kernels
            assert torch.equal(got, want), (dtype, post_op, (got.double() - want.double()).abs().max())
        else:  # other kernels round some float32 steps otherwise: within a code, or float32 rounding
            assert float((got.double() - want.double()).abs().max()) <= (1 if dtype == torch.uint8 else 1e-4)


@pytest.mark.parametrize("groups", [1, 12])
def test_a_dilated_convolution_gives_onednn_s_values(groups, native_on):
    if not cpu.onednn_available():
        pytest.skip("this torch build has no oneDNN quantized ops to compare with")
    x, qw, ws, bias = _case(2, 12, 11, 9, 12, 3, groups, 9)
    conv = cn.native_conv(qw, ws, bias, 0.0213, 9, [2, 2], groups, 0.37, "relu")
    got = cn.conv_codes(x, conv, [1, 2], [2, 2], [2, 2], 9, 4, *lr.row_bounds(torch.uint8, 4, "relu"), torch.uint8)
    with force_cpu_features("avx2"):
        want = cpu._conv(x, 0.0213, 9, qw, ws, bias, [1, 2], [2, 2], [2, 2], groups, 0.37, 4, "relu", torch.uint8)
    with unittest.mock.patch.object(cn, "bind", lambda *a: None):
        torch_path = cn.conv_codes(x, conv, [1, 2], [2, 2], [2, 2], 9, 4, *lr.row_bounds(torch.uint8, 4, "relu"), torch.uint8)
    assert got.shape == want.shape == (2, 12, 11, 5) and torch.equal(got, torch_path)
    assert int((got.int() - want.int()).abs().max()) <= (0 if lr.engine_here() == "native" else 1)


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "no AVX-512", "portable"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("order", ["native", "int_mm"])
def test_the_kernels_equal_the_torch_path_with_and_without_avx2(native_build, build, case, order):
    # The torch path: float64 sums (exact), then the same float32 steps one rounding at a time, in
    # the order of oneDNN's AVX2 kernels (the scales' product first) or of its VNNI kernels.
    native_build(build)
    n, c, h, w, cout, k, s, p, groups = case
    x, qw, ws, bias = _case(n, c, h, w, cout, k, groups, 5)
    for dtype, out_zp, post_op in FINISHES:
        conv = cn.native_conv(qw, ws, bias, 0.0213, 5, [p, p], groups, lr.row_out_scale(0.37, dtype), post_op, order)
        assert (conv.x_scale == 1.0) == (order == "native")
        args = ([s, s], [p, p], [1, 1], 5, out_zp, *lr.row_bounds(dtype, out_zp, post_op), dtype)
        got = cn.conv_codes(x, conv, *args)
        with unittest.mock.patch.object(cn, "bind", lambda *a: None):
            want = cn.conv_codes(x, conv, *args)
        assert torch.equal(got, want), (build, dtype, post_op)


def test_what_the_kernels_take():
    qw3 = torch.zeros(16, 3, 3, 3, dtype=torch.int8)  # an RGB stem: 3 channels, measured slower here
    assert not cn.takes_conv((1, 3, 32, 32), qw3, 1, [2, 2], [1, 1], [1, 1])
    dense = torch.zeros(16, 4, 3, 3, dtype=torch.int8)
    assert cn.takes_conv((1, 4, 32, 32), dense, 1, [2, 2], [1, 1], [1, 1])
    big = torch.zeros(64, 64, 3, 3, dtype=torch.int8)
    assert cn.takes_conv((1, 64, 16, 16), big, 1, [1, 1], [1, 1], [1, 1])  # 9.4M multiply-adds
    assert not cn.takes_conv((1, 64, 56, 56), big, 1, [1, 1], [1, 1], [1, 1])  # 116M: oneDNN as fast
    grouped = torch.zeros(16, 8, 3, 3, dtype=torch.int8)  # 2 groups of 8: neither dense nor depthwise
    assert not cn.takes_conv((1, 16, 8, 8), grouped, 2, [1, 1], [1, 1], [1, 1])
    dw = torch.zeros(144, 1, 3, 3, dtype=torch.int8)
    assert cn.takes_conv((1, 144, 28, 28), dw, 144, [1, 1], [1, 1], [1, 1])  # 1.0M multiply-adds
    assert not cn.takes_conv((1, 144, 56, 56), dw, 144, [1, 1], [1, 1], [1, 1])  # 4.1M: oneDNN was faster
    wide = torch.zeros(8, 4, 3, 3, dtype=torch.int8)
    wide[0, 0, 0, 0] = 65  # past the dense kernel's exact int16 pair sums without VNNI's steps
    with unittest.mock.patch.object(ln, "full_grid", lambda: False):
        assert cn.native_conv(wide, torch.ones(8), None, 1.0, 0, [1, 1], 1, 1.0, "none") is None
    with unittest.mock.patch.object(ln, "full_grid", lambda: True):
        assert cn.native_conv(wide, torch.ones(8), None, 1.0, 0, [1, 1], 1, 1.0, "none", "int_mm").x_scale == 1.0
    # With VNNI (engine "int_mm"), oneDNN's own kernels are faster past VNNI_PIXELS output pixels
    dw7 = torch.zeros(32, 1, 7, 7, dtype=torch.int8)
    assert cn.takes_conv((2, 32, 8, 8), dw7, 32, [1, 1], [3, 3], [1, 1], "int_mm")  # 128 pixels
    assert not cn.takes_conv((2, 16, 16, 16), dw7[:16], 16, [1, 1], [3, 3], [1, 1], "int_mm")  # 512
    assert cn.takes_conv((2, 16, 16, 16), dw7[:16], 16, [1, 1], [3, 3], [1, 1])  # the native engine: 401k MACs
    assert not cn.takes_conv((1, 64, 16, 16), big, 1, [1, 1], [1, 1], [1, 1], "int_mm")
    # a depthwise one up to VNNI_DEPTHWISE_PIXELS, past DEPTHWISE_MACS too (measured faster there)
    dw5 = torch.zeros(672, 1, 5, 5, dtype=torch.int8)
    assert cn.takes_conv((1, 672, 14, 14), dw5, 672, [1, 1], [2, 2], [1, 1], "int_mm")  # 196 pixels, 3.3M
    assert not cn.takes_conv((1, 672, 15, 15), dw5, 672, [1, 1], [2, 2], [1, 1], "int_mm")  # 225
    assert not cn.takes_conv((1, 672, 14, 14), dw5, 672, [1, 1], [2, 2], [1, 1])  # the native engine: past DEPTHWISE_MACS
    full = torch.full((8, 1, 3, 3), -128, dtype=torch.int8)  # the depthwise kernel sums in int32: any codes
    assert cn.native_conv(full, torch.ones(8), None, 1.0, 0, [1, 1], 8, 1.0, "none").depthwise


def test_a_full_grid_depthwise_convolution_is_exact_at_the_extremes(native_on):
    # Every tap -128 against codes 255 from zero point 0 (and 0 from 255): products of +-32640, whose
    # int16 pair sums would overflow; the sums are exact here, on the torch path and in oneDNN's kernel.
    qw = torch.full((16, 1, 3, 3), -128, dtype=torch.int8)
    qw[1::2] = 127
    for code, x_zp in ((255, 0), (0, 255)):
        x = torch.full((1, 16, 5, 5), code, dtype=torch.uint8).contiguous(memory_format=torch.channels_last)
        conv = cn.native_conv(qw, torch.ones(16), None, 1.0, x_zp, [1, 1], 16, None, "none")
        got = cn.conv_codes(x, conv, [1, 1], [1, 1], [1, 1], x_zp, 0, -float("inf"), float("inf"), torch.float32)
        want = nn.functional.conv2d(x.double() - x_zp, qw.double(), None, 1, 1, 1, 16).float()
        assert torch.equal(got, want) and float(want.abs().max()) == 9 * 255 * 128
        if cpu.onednn_available():
            onednn = cpu._conv(x, 1.0, x_zp, qw, torch.ones(16), None, [1, 1], [1, 1], [1, 1], 16, 1.0, 0, "none", torch.float32)
            assert torch.equal(onednn, want)


class Mobile(nn.Module):
    """A dense 3x3 convolution, a depthwise one with hardswish, and a 1x1 one."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1, groups=16),
                                  nn.Hardswish(), nn.Conv2d(16, 8, 1))

    def forward(self, x):
        return self.body(x)


def test_a_program_runs_the_convolutions_natively_where_the_engine_is_here_with_the_portable_codes(native_on, sqnr_db):
    torch.manual_seed(0)
    model, x = Mobile().eval(), torch.randn(1, 8, 12, 12)
    with force_cpu_features("avx2"):
        prepared = lucid_fx.prepare(model, example_inputs=(x,))
        lucid_fx.calibrate(prepared, [(torch.randn(1, 8, 12, 12),) for _ in range(4)], progress=False)
        q = lucid_fx.convert(prepared)
        portable, got = q(x), q(x)
        program = next(p for key, p in programs_of(q).items() if key[0] == "avx2")
    calls = [called(n) for n in program.graph.nodes if n.op == "call_function"]
    native_here = lr.engine_here() == "native" and ln.available()
    assert calls.count(cn.conv_codes) == (2 if native_here else 0)  # the 3x3 and the depthwise; the 1x1 is a linear
    assert (pr.pointwise_rows in calls) == native_here
    assert torch.equal(got, portable)
    assert sqnr_db(model(x), got) >= 30


def test_with_vnni_a_program_runs_small_convolutions_on_the_vnni_kernels_with_the_portable_codes(native_on, sqnr_db):
    # Where oneDNN runs its VNNI kernels and the build has VNNI's steps, the engine "int_mm" runs small
    # convolutions natively (their float steps in VNNI's order) and a 1x1 one as a linear: the codes of
    # the portable graph, which calls oneDNN, bit for bit.
    target = resolve_target("cpu")
    if lr.row_engine(target) != "int_mm" or not ln.full_grid():
        pytest.skip(f"needs a CPU with VNNI, as its own kind (engine here: {lr.row_engine(target)}; VNNI GEMM: "
                    f"{ln.full_grid()})")
    torch.manual_seed(0)
    model, x = Mobile().eval(), torch.randn(2, 8, 8, 8)  # 128 output pixels: cn.VNNI_PIXELS
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    lucid_fx.calibrate(prepared, [(torch.randn(2, 8, 8, 8),) for _ in range(4)], progress=False)
    q = lucid_fx.convert(prepared)
    portable, got = q(x), q(x)
    program = next(p for key, p in programs_of(q).items() if key[0] == target.cpu.name)
    calls = [called(n) for n in program.graph.nodes if n.op == "call_function"]
    # the 3x3 with relu and the depthwise one with hardswish (oneDNN's, in VNNI's order) natively
    assert calls.count(cn.conv_codes) == 2 and torch.ops.onednn.qconv2d_pointwise.default not in calls
    assert pr.pointwise_rows in calls
    assert torch.equal(got, portable)
    assert sqnr_db(model(x), got) >= 30


class Pointwise(nn.Module):
    """EfficientNet's 1x1 expansion and projection at 14x14: past SMALL_GEMM_MNK multiply-adds."""

    def __init__(self):
        super().__init__()
        self.expand, self.project = nn.Conv2d(112, 672, 1), nn.Conv2d(672, 112, 1)

    def forward(self, x):
        return self.project(torch.relu(self.expand(x)))


def test_with_vnni_a_program_runs_1x1_convolutions_of_up_to_1024_pixels_on_the_vnni_gemm(native_on, sqnr_db):
    # oneDNN's 1x1 convolution took 1.2-3.5x the VNNI GEMM's time up to 784 pixels (linear_row.py):
    # both 1x1 convolutions (196 pixels, 14.8M multiply-adds each) run as linears, with the portable
    # graph's codes, which calls oneDNN's convolution.
    target = resolve_target("cpu")
    if lr.row_engine(target) != "int_mm" or not ln.full_grid():
        pytest.skip(f"needs a CPU with VNNI, as its own kind (engine here: {lr.row_engine(target)}; VNNI GEMM: "
                    f"{ln.full_grid()})")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model, x = Pointwise().eval(), torch.randn(1, 112, 14, 14)
        q = lucid_fx.quantize(model, (x,), [torch.randn(1, 112, 14, 14) for _ in range(4)], progress=False)
        portable, program, calls = lowered(q, x)
        assert calls.count(pr.pointwise_rows) == 2 and torch.ops.onednn.qconv2d_pointwise.default not in calls
        assert torch.equal(program(x), portable)
        assert sqnr_db(model(x), portable) >= 30
    finally:
        torch.set_num_threads(before)


def _vnni_target():
    target = resolve_target("cpu")
    if lr.row_engine(target) != "int_mm" or not ln.full_grid():
        pytest.skip(f"needs a CPU with VNNI, as its own kind (engine here: {lr.row_engine(target)}; VNNI GEMM: "
                    f"{ln.full_grid()})")
    return target


class DepthwiseSiLU(nn.Module):
    """EfficientNet's depthwise 5x5 with SiLU at 14x14 (196 output pixels), then a 1x1 projection."""

    def __init__(self, act: type = nn.SiLU):
        super().__init__()
        self.dw, self.act, self.project = nn.Conv2d(96, 96, 5, padding=2, groups=96), act(), nn.Conv2d(96, 24, 1)

    def forward(self, x):
        return self.project(self.act(self.dw(x)))


@pytest.mark.parametrize("act", [nn.Hardswish, nn.SiLU])
def test_with_vnni_a_program_runs_a_14x14_depthwise_convolution_natively_with_the_portable_codes(native_on, sqnr_db, act):
    # 196 output pixels (VNNI_DEPTHWISE_PIXELS): oneDNN's hardswish fused as before; SiLU after the float32 result
    # (silu_after_float), the program's native one and the portable graph's oneDNN one equal, then the same SiLU pass
    target = _vnni_target()
    torch.manual_seed(0)
    model, x = DepthwiseSiLU(act).eval(), torch.randn(1, 96, 14, 14)
    q = lucid_fx.quantize(model, (x,), [torch.randn(1, 96, 14, 14) for _ in range(4)], progress=False)
    portable, program, calls = lowered(q, x)
    assert calls.count(cn.conv_codes) == 1
    conv = next(n for n in program.graph.nodes if n.target is cn.conv_codes)
    silu = act is nn.SiLU
    assert conv.args[-1] == (torch.float32 if silu else torch.uint8)
    assert [n.args[1] for n in conv.users if n.target is native.post_op_codes] == (["silu"] if silu else [])
    assert cn.silu_after_float(target, True, x.shape, torch.zeros(96, 1, 5, 5, dtype=torch.int8), 96, [1, 1], [2, 2],
                               [1, 1])
    assert torch.equal(program(x), portable)
    assert sqnr_db(model(x), portable) >= 30


def test_the_portable_silu_convolution_is_its_float_result_then_silu_where_the_kernels_take_it(native_on):
    _vnni_target()
    g = torch.Generator().manual_seed(1)
    for size, float_route in ((14, True), (15, False)):
        x = torch.randint(0, 256, (1, 96, size, size), dtype=torch.uint8, generator=g).contiguous(memory_format=torch.channels_last)
        qw = torch.randint(-128, 128, (96, 1, 5, 5), dtype=torch.int8, generator=g)
        args = (x, 0.02, 5, qw, torch.rand(96, generator=g) * 0.01, torch.randn(96, generator=g), [1, 1], [2, 2], [1, 1], 96)
        got = cpu._conv(*args, 0.05, 10, "silu", torch.uint8)
        after = native.post_op_codes(cpu._conv(*args, 1.0, 0, "none", torch.float32), "silu", 0.05, 10, torch.uint8)
        with unittest.mock.patch.object(cn, "silu_after_float", lambda *a: False):
            swish = cpu._conv(*args, 0.05, 10, "silu", torch.uint8)  # oneDNN's fused swish
        assert torch.equal(got, after if float_route else swish)
        assert int((after.int() - swish.int()).abs().max()) <= 1  # oneDNN's swish approximates exp: within a code


def test_on_the_avx2_engine_a_small_depthwise_silu_convolution_computes_silu_after_its_float_result(native_on, sqnr_db):
    # where oneDNN runs its AVX2 kernels here (an AVX2 CPU, or any x86 one capped at AVX2: the forced-kind runs), the
    # native engine takes the depthwise convolution (up to DEPTHWISE_MACS) into float32, then the SiLU pass; elsewhere
    # the forced kind's program keeps oneDNN's swish; the portable graph's codes either way
    torch.manual_seed(0)
    model, x = DepthwiseSiLU().eval(), torch.randn(1, 96, 10, 10)
    with force_cpu_features("avx2"):
        q = lucid_fx.quantize(model, (x,), [torch.randn(1, 96, 10, 10) for _ in range(4)], progress=False)
        portable, program, calls = lowered(q, x)
        native_here = lr.engine_here() == "native" and ln.available()
        assert cn.silu_after_float(resolve_target("cpu"), True, x.shape, torch.zeros(96, 1, 5, 5, dtype=torch.int8), 96,
                                   [1, 1], [2, 2], [1, 1]) == native_here
        assert torch.equal(program(x), portable)
    silu = [n for n in program.graph.nodes if n.target is native.post_op_codes and n.args[1] == "silu"]
    assert calls.count(cn.conv_codes) == len(silu) == (1 if native_here else 0)
    assert sqnr_db(model(x), portable) >= 30


def test_a_silu_convolution_the_kernels_do_not_take_keeps_oneDNN_s_swish(native_on):
    # a dense one, a depthwise one past VNNI_DEPTHWISE_PIXELS, and one under a forced CPU kind whose
    # oneDNN kernels are not this machine's (no engine here): oneDNN's fused swish
    target = _vnni_target()
    dw = torch.zeros(96, 1, 5, 5, dtype=torch.int8)
    assert not cn.silu_after_float(target, True, (1, 96, 15, 15), dw, 96, [1, 1], [2, 2], [1, 1])
    assert not cn.silu_after_float(target, True, (1, 96, 14, 14), torch.zeros(96, 96, 1, 1, dtype=torch.int8), 1,
                                   [1, 1], [0, 0], [1, 1])
    assert not cn.silu_after_float(target, False, (1, 96, 14, 14), dw, 96, [1, 1], [2, 2], [1, 1])  # oneDNN off
    with force_cpu_features("avx2"):
        assert not cn.silu_after_float(resolve_target("cpu"), True, (1, 96, 14, 14), dw, 96, [1, 1], [2, 2], [1, 1])
    torch.manual_seed(0)
    model, x = DepthwiseSiLU().eval(), torch.randn(1, 96, 15, 15)
    q = lucid_fx.quantize(model, (x,), [torch.randn(1, 96, 15, 15) for _ in range(4)], progress=False)
    portable, program, calls = lowered(q, x)
    swish = [n for n in program.graph.nodes if called(n) is torch.ops.onednn.qconv2d_pointwise.default
             and operands(n)[-3] == "swish"]
    assert len(swish) == 1 and cn.conv_codes not in calls
    assert torch.equal(program(x), portable)
