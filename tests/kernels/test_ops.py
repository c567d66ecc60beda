"""lucid_fx::* int8 ops against dequantize -> float op -> quantize oracles, written here with
lucid_fx.quantization; distances are in output codes (one step = one code)."""

import contextlib

import pytest
import torch
import torch.nn.functional as F

import lucid_fx.kernels as K
import lucid_fx.quantization as Q
from lucid_fx.kernels import cpu
from lucid_fx.kernels import linear_row as lr
from lucid_fx.kernels.cpu_features import detected_cpu_features
from _grid import onednn_exact

ops = torch.ops.lucid_fx
W_RANGE = K.weight_quant_range("cpu")
STORAGE = {torch.uint8: "quint8", torch.int8: "qint8"}


def act(shape, dtype=torch.uint8, scale=0.04, seed=0):
    """Random activation codes and their qparams (zero point mid-grid)."""
    g = torch.Generator().manual_seed(seed)
    zp = 120 if dtype == torch.uint8 else -7
    return Q.quantize(torch.randn(shape, generator=g) * 2, scale, zp, STORAGE[dtype]), scale, zp


def weight(shape, per_channel=True, qrange=W_RANGE, seed=1):
    """int8 weight codes on ``qrange`` with symmetric scales, per channel or one shared value."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    amax = w.abs().flatten(1).amax(1) if per_channel else w.abs().max().expand(shape[0])
    scale = (amax / qrange[1]).contiguous()
    codes = Q.quantize(w, scale, torch.zeros(shape[0], dtype=torch.int64), "qint8", ch_axis=0)
    return codes.clamp(*qrange), scale


def deq_w(qw, ws):
    return Q.dequantize(qw, ws, torch.zeros_like(ws, dtype=torch.int64), ch_axis=0)


def finish(y, post_op, out_scale, out_zp, dtype):
    y = {"relu": torch.relu, "hardswish": F.hardswish, "silu": F.silu, "gelu": F.gelu,
         "gelu_tanh": lambda v: F.gelu(v, approximate="tanh"), "tanh": torch.tanh,
         "sigmoid": torch.sigmoid}.get(post_op, lambda v: v)(y)
    return y if dtype == torch.float32 else Q.quantize(y, out_scale, out_zp, STORAGE[dtype])


def assert_close(out, expected):
    """Float results to float32 accuracy; codes within one step, and off by one only on rounding
    near-ties (at most 2% of codes), so a biased rounding cannot pass."""
    assert out.dtype == expected.dtype and out.shape == expected.shape
    if out.dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()) + 1e-6)
    else:
        diff = (out.int() - expected.int()).abs()
        assert diff.max().item() <= 1
        assert diff.sum().item() <= max(1, 0.02 * diff.numel())


@pytest.fixture(params=["onednn", "int_mm"])
def backend(request):
    """Run the test through oneDNN and through the torch._int_mm fallback."""
    if request.param == "onednn" and not K.onednn_available():
        pytest.fail("this torch build has no oneDNN quantized ops; the oneDNN path cannot be tested")
    with K.use_onednn(request.param == "onednn"):
        yield request.param


@pytest.fixture(params=["onednn-conv", "onednn-linear", "int_mm"])
def linear_backend(request, monkeypatch):
    """A linear through oneDNN's 1x1 convolution (CPUs without VNNI), oneDNN's linear primitive
    (CPUs with VNNI) and the torch._int_mm fallback, whatever this CPU is."""
    if request.param != "int_mm" and not K.onednn_available():
        pytest.fail("this torch build has no oneDNN quantized ops; the oneDNN path cannot be tested")
    monkeypatch.setattr(cpu, "_linear_as_conv", lambda: request.param == "onednn-conv")
    with K.use_onednn(request.param != "int_mm"):
        yield request.param


# ---- quantize / dequantize: bit-for-bit equal to lucid_fx.quantization ----


@pytest.mark.parametrize("dtype,qrange", [(torch.uint8, (0, 255)), (torch.int8, (-128, 127)), (torch.int8, (-64, 63)),
                                          (torch.int32, (-(2**31), 2**31 - 1))])
@pytest.mark.parametrize("scale", [0.037, 1 / 255, 0.1, 2.5e-4])
def test_quantize_per_tensor_is_bit_exact(dtype, qrange, scale):
    zp = 3
    x = torch.cat([torch.randn(4000) * 6, (torch.arange(-300, 300) + 0.5) * scale])  # ties included
    kept = x.clone()
    expected = Q.quantize(x, scale, zp, STORAGE.get(dtype, "qint32")).clamp(*qrange)
    out = ops.quantize_per_tensor(x, scale, zp, *qrange, dtype)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert torch.equal(x, kept)  # the input is never a scratch buffer
    assert torch.equal(ops.quantize_per_tensor(x.double(), scale, zp, *qrange, dtype), expected)
    assert torch.equal(ops.dequantize_per_tensor(out, scale, zp), Q.dequantize(out, scale, zp))


def test_quantize_per_channel_is_bit_exact():
    x = torch.randn(6, 5, 3)
    scale, zp = torch.rand(5) * 0.05 + 0.01, torch.randint(-3, 4, (5,))
    expected = Q.quantize(x, scale, zp, "qint8", ch_axis=1).clamp(-64, 63)
    out = ops.quantize_per_channel(x, scale, zp, 1, -64, 63, torch.int8)
    assert torch.equal(out, expected)
    assert torch.equal(ops.dequantize_per_channel(out, scale, zp, 1), Q.dequantize(out, scale, zp, ch_axis=1))


# ---- linear ----


@pytest.mark.parametrize("shape", [(1, 13), (5, 13), (2, 3, 13), (33, 64)])
@pytest.mark.parametrize("post_op", ["none", "relu", "hardswish", "silu", "gelu", "gelu_tanh", "tanh", "sigmoid"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
@pytest.mark.parametrize("per_channel", [True, False])
def test_linear(linear_backend, shape, post_op, out_dtype, per_channel):
    qx, xs, xz = act(shape)
    qw, ws = weight((7, shape[-1]), per_channel)
    bias = torch.randn(7)
    y = F.linear(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias)
    expected = finish(y, post_op, 0.05, 100, out_dtype or torch.uint8)
    assert_close(ops.linear(qx, xs, xz, qw, ws, bias, 0.05, 100, post_op, out_dtype), expected)


@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_linear_int8_activations_without_bias(linear_backend, out_dtype):
    qx, xs, xz = act((5, 24), torch.int8)
    qw, ws = weight((9, 24))
    expected = finish(F.linear(Q.dequantize(qx, xs, xz), deq_w(qw, ws)), "relu", 0.03, -5, out_dtype or torch.int8)
    assert_close(ops.linear(qx, xs, xz, qw, ws, None, 0.03, -5, "relu", out_dtype), expected)


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "int_mm"])
def test_full_range_weight_is_exact_on_every_cpu(onednn):
    """A weight outside weight_quant_range (possible by hand, or made for another CPU) must not hit
    oneDNN's int16 saturation, on the oneDNN path or the _int_mm one."""
    qx, xs, xz = act((16, 256), scale=0.02)
    qw, ws = weight((32, 256), qrange=(-128, 127), seed=3)
    expected = F.linear(Q.dequantize(qx, xs, xz), deq_w(qw, ws))
    # Only a CPU that is, and is treated as, without VNNI says it falls back.
    warns = onednn and not detected_cpu_features().vnni and not K.cpu_features().vnni
    with K.use_onednn(onednn), pytest.warns(RuntimeWarning, match="outside") if warns else contextlib.nullcontext():
        out = ops.linear(qx, xs, xz, qw, ws, None, 1.0, 0, "none", torch.float32)
    assert_close(out, expected)


@pytest.mark.parametrize("kind, grid", [("avx2", (-64, 63)), ("avx512_vnni", (-128, 127)), ("amx", (-128, 127))])
def test_weight_quant_range_follows_the_cpu_kind(kind, grid):
    with K.force_cpu_features(kind):
        assert K.weight_quant_range(torch.device("cpu")) == grid
        assert K.weight_quant_range("cuda") == (-128, 127)


def test_weight_quant_range_of_this_cpu():
    assert K.weight_quant_range("cpu") == ((-128, 127) if K.cpu_features().vnni else (-64, 63))


# ---- packed-weight cache ----


def test_weight_is_packed_once_and_repacked_when_it_changes(monkeypatch):
    monkeypatch.setattr(cpu, "takes_row", lambda *args: None)  # oneDNN for every batch (row engines: test_linear_row.py)
    qx, xs, xz = act((4, 16))
    qw, ws = weight((8, 16))
    with K.use_onednn(True):
        before = cpu.PACKED.builds
        first = [ops.linear(qx, xs, xz, qw, ws, None, 0.05, 100, "none", None) for _ in range(3)]
        assert cpu.PACKED.builds == before + 1
        assert all(torch.equal(first[0], o) for o in first)
        copy = qw.clone()  # a new tensor (like .to(device)) has its own pack
        ops.linear(qx, xs, xz, copy, ws, None, 0.05, 100, "none", None)
        assert cpu.PACKED.builds == before + 2
        qw.mul_(-1)  # in place: _version moves, the stale pack must not be used
        out = ops.linear(qx, xs, xz, qw, ws, None, 0.05, 100, "none", None)
        assert cpu.PACKED.builds == before + 3
    expected = Q.quantize(F.linear(Q.dequantize(qx, xs, xz), deq_w(qw, ws)), 0.05, 100, "quint8")
    assert_close(out, expected)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_activation_zero_point_is_folded_into_the_bias_once_per_grid(dtype):
    # oneDNN runs with a zero point of 0 (faster) and the bias carries -x_scale * w_scale * zp * rowsum(w);
    # int8 codes go in as uint8 (zero point + 128), so they are folded too.
    qx, xs, xz = act((5, 16), dtype)
    qw, ws = weight((8, 16))
    bias = torch.randn(8)
    out_zp = 100 if dtype == torch.uint8 else 3

    def expected():
        return finish(F.linear(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias), "none", 0.05, out_zp, dtype)

    with K.use_onednn(True):
        before = cpu.FOLDED_BIASES.builds
        for _ in range(2):
            assert_close(ops.linear(qx, xs, xz, qw, ws, bias, 0.05, out_zp, "none", None), expected())
        assert cpu.FOLDED_BIASES.builds == before + 2  # the weight's sums, then the folded bias
        bias.add_(1.0)  # a bias changed in place is folded again (the sums stay)
        assert_close(ops.linear(qx, xs, xz, qw, ws, bias, 0.05, out_zp, "none", None), expected())
        assert cpu.FOLDED_BIASES.builds == before + 3


def test_folded_biases_stay_bounded_and_follow_replaced_tensors():
    # Dynamic quantization gives every batch its own grid: only FOLDED_GRIDS are kept per weight,
    # the rest are folded per call. A new bias tensor (even one reusing a dead one's id) is refolded.
    qw, ws = weight((8, 16))
    with K.use_onednn(True):
        for i in range(3 * cpu.FOLDED_GRIDS):
            qx, xs, xz = act((4, 16), scale=0.03 + 0.001 * i, seed=i)
            bias = torch.full((8,), float(i))
            y = F.linear(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias)
            assert_close(ops.linear(qx, xs, xz, qw, ws, bias, 1.0, 0, "none", torch.float32), y)
            qx2, xs2, xz2 = act((4, 16), scale=0.03, seed=0)  # one grid again, with this call's bias
            y2 = F.linear(Q.dequantize(qx2, xs2, xz2), deq_w(qw, ws), bias)
            assert_close(ops.linear(qx2, xs2, xz2, qw, ws, bias, 1.0, 0, "none", torch.float32), y2)
            del bias
        assert cpu.FOLDED_BIASES.count(qw, lambda k: k[0] == "zero point in bias") == cpu.FOLDED_GRIDS


@pytest.mark.parametrize("rows", [1, 4])
def test_a_replaced_or_edited_bias_reaches_the_result_at_every_batch(rows):
    # One row runs on linear_row where the Target says so: its constants once came from a cache
    # keyed by the weight alone, so a new bias (or one edited in place) was silently ignored, and
    # every dynamic-quantization grid added an entry that lived as long as the weight.
    qw, ws = weight((8, 16))
    qx, xs, xz = act((rows, 16), scale=0.03, seed=0)
    builds = cpu.PACKED.builds
    with K.use_onednn(True):
        for i in range(3):
            bias = torch.full((8,), float(i))
            y = F.linear(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias)
            assert_close(ops.linear(qx, xs, xz, qw, ws, bias, 1.0, 0, "none", torch.float32), y)
            bias.add_(0.5)  # the same tensor, edited
            assert_close(ops.linear(qx, xs, xz, qw, ws, bias, 1.0, 0, "none", torch.float32), y + 0.5)
        for i in range(3 * cpu.FOLDED_GRIDS):  # one grid per batch, as dynamic quantization makes
            ops.linear(qx, 0.03 + 0.001 * i, xz, qw, ws, bias, 1.0, 0, "none", torch.float32)
    assert cpu.PACKED.count(qw, lambda k: k[0] == "row") == 0
    assert cpu.PACKED.builds - builds <= 1  # at most the one oneDNN pack (rows > 1)


@pytest.mark.parametrize("kind", ["avx2", "avx512_vnni", "amx"])
def test_no_fold_where_the_accumulator_could_round_in_float32(kind):
    # 255 * sum|w| >= 2^24: the raw accumulator would lose bits in float32, so the zero point stays
    # with oneDNN, which subtracts it in int32; codes then equal the exact integer result.
    k = 4096
    qw = torch.full((2, k), 63, dtype=torch.int8)
    qw[1, :64] = 1
    ws = torch.full((2,), 1.0)
    qx = torch.full((1, k), 254, dtype=torch.uint8)
    qx[0, :64] = 255
    with K.use_onednn(True), K.force_cpu_features(kind):
        before = cpu.FOLDED_BIASES.count(qw, lambda key: key[0] == "zero point in bias")
        out = ops.linear(qx, 1.0, 254, qw, ws, None, 1.0, 0, "none", torch.float32)
        assert cpu.FOLDED_BIASES.count(qw, lambda key: key[0] == "zero point in bias") == before == 0
    exact = ((qx.long() - 254) * qw.long()).sum(1).double()
    assert torch.equal(out[0].double(), exact)
    # One output code per accumulator unit: oneDNN's convolution would round its zero-point
    # compensation here (2 codes off, measured), so such a linear runs on oneDNN's linear; on AMX
    # CPUs that linear was measured 2 codes off too, so there it takes the exact _int_mm path.
    qw = torch.full((4, k), 63, dtype=torch.int8)
    qw[:, -64:] = 1
    qx = torch.full((64, k), 254, dtype=torch.uint8)
    qx[:, -64:] = (torch.randint(-1, 2, (64, 64), generator=torch.Generator().manual_seed(0)) + 254).to(torch.uint8)
    builds = cpu.PACKED.builds
    with K.use_onednn(True), K.force_cpu_features(kind):
        codes = ops.linear(qx, 0.02, 254, qw, torch.full((4,), 0.01), None, 0.02 * 0.01, 128, "none", None)
        # a row engine (the native GEMM on a real AVX2 CPU) takes the zero point as exact int32 offsets
        engine = lr.takes_row(K.resolve_target("cpu"), True, "none", torch.uint8, 64, 4, k)
        checked = K.resolve_target("cpu").amx_zero_point_check  # a real AMX CPU runs its oneDNN whatever kind is forced
    assert checked == (kind == "amx" or detected_cpu_features().amx)
    truth = (qx.int() - 254)[:, -64:].sum(1, keepdim=True) + 128
    assert torch.equal(codes.int(), truth.expand(64, 4))
    assert cpu.PACKED.builds == builds + (0 if checked or engine else 1)  # AMX: not given to oneDNN at all


def test_each_backend_runs_its_own_path(monkeypatch):
    monkeypatch.setattr(cpu, "takes_row", lambda *args: None)  # oneDNN for every batch (row engines: test_linear_row.py)
    from lucid_fx.kernels import int_mm

    qx, xs, xz = act((4, 16))
    for onednn, cache, other in [(True, cpu.PACKED, int_mm.PREPARED), (False, int_mm.PREPARED, cpu.PACKED)]:
        qw, ws = weight((8, 16))
        before, other_before = cache.builds, other.builds
        with K.use_onednn(onednn):
            ops.linear(qx, xs, xz, qw, ws, None, 0.05, 100, "none", None)
        # oneDNN inexact on this grid (a VNNI kind forced on an AVX2 CPU): its pack is refused, _int_mm serves
        fallback = onednn and not onednn_exact(K.resolve_target("cpu"))
        assert (cache.builds, other.builds) == (before + 1, other_before + fallback)


# ---- convolutions ----

CONV2D = [  # (N, C, H, W, O, k, stride, padding, dilation, groups)
    (1, 3, 9, 9, 5, 3, 1, 1, 1, 1),
    (2, 4, 8, 7, 6, 3, 2, 1, 1, 2),  # grouped, stride 2
    (1, 8, 10, 10, 8, 3, 1, 1, 1, 8),  # depthwise
    (1, 5, 7, 7, 5, 1, 1, 0, 1, 1),  # 1x1
    (2, 6, 11, 11, 4, 3, 2, 2, 2, 2),  # dilated
]


def conv_args(case, dtype=torch.uint8, channels_last=False):
    n, c, h, w, o, k, s, p, d, g = case
    qx, xs, xz = act((n, c, h, w), dtype)
    if channels_last:
        qx = qx.contiguous(memory_format=torch.channels_last)
    qw, ws = weight((o, c // g, k, k), per_channel=case[0] == 1)
    return qx, xs, xz, qw, ws, torch.randn(o), [s, s], [p, p], [d, d], g


@pytest.mark.parametrize("case", CONV2D)
@pytest.mark.parametrize("post_op", ["none", "relu", "hardswish", "silu"])
@pytest.mark.parametrize("out_dtype", [None, torch.float32])
def test_conv2d(backend, case, post_op, out_dtype):
    qx, xs, xz, qw, ws, bias, s, p, d, g = conv_args(case)
    y = F.conv2d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias, s, p, d, g)
    out = ops.conv2d(qx, xs, xz, qw, ws, bias, s, p, d, g, 0.06, 90, post_op, out_dtype)
    assert_close(out, finish(y, post_op, 0.06, 90, out_dtype or torch.uint8))
    assert out.is_contiguous()  # NCHW in, NCHW out


@pytest.mark.parametrize("case", [CONV2D[0], CONV2D[3], (1, 4, 9, 9, 6, 3, 2, 0, 1, 2)], ids=["padded", "1x1", "3x3-unpadded"])
def test_unpadded_convolutions_fold_the_zero_point_into_the_bias(case):
    # Without padding every output sums the whole window, so oneDNN can run with zero point 0.
    qx, xs, xz, qw, ws, bias, s, p, d, g = conv_args(case)
    expected = finish(F.conv2d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias, s, p, d, g), "none", 0.06, 90, torch.uint8)
    with K.use_onednn(True):
        before = cpu.FOLDED_BIASES.builds
        assert_close(ops.conv2d(qx, xs, xz, qw, ws, bias, s, p, d, g, 0.06, 90, "none", None), expected)
        folds = not any(p) and onednn_exact(K.resolve_target("cpu"))  # else no oneDNN call to fold for
        assert cpu.FOLDED_BIASES.builds - before == (2 if folds else 0)  # the weight's sums and the bias


@pytest.mark.parametrize("case", CONV2D[:3])
def test_conv2d_channels_last_and_int8(backend, case):
    qx, xs, xz, qw, ws, bias, s, p, d, g = conv_args(case, torch.int8, channels_last=True)
    y = F.conv2d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias, s, p, d, g)
    out = ops.conv2d(qx, xs, xz, qw, ws, bias, s, p, d, g, 0.06, -10, "relu", None)
    assert_close(out, finish(y, "relu", 0.06, -10, torch.int8))
    assert out.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("c,o,k,s,p,d,g", [(4, 6, 3, 2, 1, 1, 1), (4, 6, 3, 1, 2, 2, 2), (5, 5, 5, 1, 2, 1, 5)])
@pytest.mark.parametrize("post_op", ["none", "relu", "hardswish", "silu", "gelu"])  # oneDNN's conv1d fuses the first two
def test_conv1d(backend, c, o, k, s, p, d, g, post_op):
    qx, xs, xz = act((2, c, 17))
    qw, ws = weight((o, c // g, k))
    y = F.conv1d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), None, s, p, d, g)
    out = ops.conv1d(qx, xs, xz, qw, ws, None, [s], [p], [d], g, 0.05, 128, post_op, None)
    assert_close(out, finish(y, post_op, 0.05, 128, torch.uint8))
    assert out.is_contiguous()


@pytest.mark.parametrize("case", CONV2D)
@pytest.mark.parametrize("post_op", ["none", "relu"])
@pytest.mark.parametrize("out_dtype,dtype", [(None, torch.uint8), (torch.float32, torch.uint8), (None, torch.int8)])
def test_conv2d_add(backend, case, post_op, out_dtype, dtype):
    qx, xs, xz, qw, ws, bias, s, p, d, g = conv_args(case, dtype)
    y = F.conv2d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias, s, p, d, g)
    qother, os_, oz = act(y.shape, dtype, scale=0.0517, seed=7)
    kept = qother.clone()
    out_zp = 100 if dtype == torch.uint8 else -20
    out = ops.conv2d_add(qx, xs, xz, qw, ws, bias, s, p, d, g, qother, os_, oz, 0.0811, out_zp, post_op, out_dtype)
    expected = finish(y + Q.dequantize(qother, os_, oz), post_op, 0.0811, out_zp, out_dtype or dtype)
    assert_close(out, expected)
    assert torch.equal(qother, kept)  # oneDNN's sum writes into its accumulator: never the caller's tensor


def test_conv2d_add_with_a_broadcast_other(backend):
    qx, xs, xz, qw, ws, bias, s, p, d, g = conv_args(CONV2D[1])
    qother, os_, oz = act((1, 6, 1, 1), seed=7)
    out = ops.conv2d_add(qx, xs, xz, qw, ws, bias, s, p, d, g, qother, os_, oz, 0.0811, 100, "none", None)
    y = F.conv2d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias, s, p, d, g) + Q.dequantize(qother, os_, oz)
    assert_close(out, finish(y, "none", 0.0811, 100, torch.uint8))


def test_conv2d_add_channels_last_other_is_not_mutated(backend):
    qx, xs, xz, qw, ws, bias, s, p, d, g = conv_args(CONV2D[0], channels_last=True)
    qother, os_, oz = act((1, 5, 9, 9), seed=7)
    qother = qother.contiguous(memory_format=torch.channels_last)
    kept = qother.clone()
    out = ops.conv2d_add(qx, xs, xz, qw, ws, bias, s, p, d, g, qother, os_, oz, 0.08, 100, "relu", None)
    y = F.conv2d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias, s, p, d, g) + Q.dequantize(kept, os_, oz)
    assert_close(out, finish(y, "relu", 0.08, 100, torch.uint8))
    assert torch.equal(qother, kept)


# ---- elementwise, matmul, tables, softmax, cat, pooling ----


@pytest.mark.parametrize("name,fn", [("add", torch.add), ("mul", torch.mul)])
@pytest.mark.parametrize("shapes", [((2, 3, 5), (2, 3, 5)), ((2, 3, 4, 5), (1, 3, 1, 1)), ((1, 5), (4, 1))])
@pytest.mark.parametrize("post_op", ["none", "relu"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_add_mul(name, fn, shapes, post_op, dtype):
    # Scales without a common measure: with 0.03, 0.05 and 0.08 one sum in eight is an exact tie.
    qa, sa, za = act(shapes[0], dtype, 0.0313, seed=1)
    qb, sb, zb = act(shapes[1], dtype, 0.0517, seed=2)
    out_scale, out_zp = (0.0811, 100) if dtype == torch.uint8 else (0.0811, 3)
    expected = finish(fn(Q.dequantize(qa, sa, za), Q.dequantize(qb, sb, zb)), post_op, out_scale, out_zp, dtype)
    assert_close(getattr(ops, name)(qa, sa, za, qb, sb, zb, out_scale, out_zp, post_op), expected)


@pytest.mark.parametrize("shapes", [((5, 13), (13, 7)), ((2, 3, 5, 13), (2, 3, 13, 7)), ((3, 1, 16), (16, 9)),
                                    ((2, 4, 17, 8), (1, 4, 8, 17))])
def test_matmul(shapes):
    qa, sa, za = act(shapes[0], scale=0.03, seed=1)
    qb, sb, zb = act(shapes[1], scale=0.02, seed=2)
    expected = Q.quantize(Q.dequantize(qa, sa, za) @ Q.dequantize(qb, sb, zb), 0.07, 128, "quint8")
    assert_close(ops.matmul(qa, sa, za, qb, sb, zb, 0.07, 128), expected)


@pytest.mark.parametrize("fn", [torch.sigmoid, torch.tanh, F.hardsigmoid, F.hardswish, F.gelu, torch.exp])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_lut_matches_the_float_function_exactly(fn, dtype):
    qx, xs, xz = act((3, 7, 5), dtype, 0.03)
    qrange = (0, 255) if dtype == torch.uint8 else (-128, 127)
    table = K.make_lut(fn, xs, xz, qrange, 1 / 128, 64, (0, 255))
    expected = Q.quantize(fn(Q.dequantize(qx, xs, xz)), 1 / 128, 64, "quint8")
    assert table.shape == (256,) and table.dtype == torch.uint8
    assert torch.equal(ops.lut(qx, table), expected)


@pytest.mark.parametrize(
    "shape, channels_last",
    [((4, 1024), False), ((70, 100), False), ((2, 8, 16, 16), True), ((5000,), False), ((3, 40, 50), False)],
    ids=["rows-of-1024", "last-dim-100", "channels-last", "1-d-take", "last-dim-50-take"],
)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_lut_on_large_tensors_equals_a_plain_lookup(shape, channels_last, dtype):
    torch.manual_seed(0)
    info = torch.iinfo(dtype)
    codes = torch.randint(info.min, info.max + 1, shape, dtype=dtype)
    if channels_last:
        codes = codes.contiguous(memory_format=torch.channels_last)
    table = torch.randint(0, 256, (256,), dtype=torch.uint8)
    expected = table[(codes.to(torch.int64) - info.min)]
    out = ops.lut(codes, table)
    assert out.shape == codes.shape and torch.equal(out, expected)


@pytest.mark.parametrize("case", ["int8-table", "odd-size", "odd-offset", "transposed", "small"])
def test_lut_pair_path_and_its_fallbacks_equal_a_plain_lookup(case, native_env):
    # The CPU kernel reads two codes at a time from a 65536-entry pair table; tensors it cannot
    # read that way (odd sizes or offsets, non-dense, small) take the one-code lookup. The native
    # kernels, which take most lookups where they are loaded, are off here (tests/kernels/test_native.py).
    from lucid_fx.kernels.cpu_float import PAIR_LOOKUP_MIN, PAIR_TABLES

    native_env(LUCID_FX_NATIVE="0")

    torch.manual_seed(1)
    dtype = torch.int8 if case == "int8-table" else torch.uint8
    n = PAIR_LOOKUP_MIN + 256  # past the size from which the pair table pays
    codes = torch.randint(0, 256, (n + 2,), dtype=torch.uint8)
    codes = {"odd-size": codes[:n + 1], "odd-offset": codes[1:n + 1], "transposed": codes[:n].view(256, -1).t(),
             "small": codes[:100]}.get(case, codes)
    table = torch.randint(-128, 128, (256,), dtype=torch.int8) if dtype == torch.int8 else torch.randint(0, 256, (256,), dtype=torch.uint8)
    builds = PAIR_TABLES.builds
    out = ops.lut(codes, table)
    assert out.dtype == table.dtype and out.shape == codes.shape
    assert torch.equal(out, table[codes.to(torch.int64)])
    assert PAIR_TABLES.builds - builds == (1 if case == "int8-table" else 0)
    if case == "int8-table":  # the same table again is not rebuilt; changed in place, it is
        signed = (codes.to(torch.int16) - 128).to(torch.int8)
        assert torch.equal(ops.lut(signed, table), table[codes.to(torch.int64)])
        table[0] += 1
        assert torch.equal(ops.lut(codes, table), table[codes.to(torch.int64)])
        assert PAIR_TABLES.builds - builds == 3  # (uint8 codes, int8 codes), then uint8 codes again


def test_make_lut_on_a_narrow_grid_and_signed_output():
    # int4-style input grid [-8, 7] stored in int8; int8 output on [-100, 100].
    table = K.make_lut(lambda v: v * 3, 0.5, 0, (-8, 7), 0.25, 0, (-100, 100))
    codes = torch.arange(-8, 8, dtype=torch.int8)
    assert table.dtype == torch.int8
    assert ops.lut(codes, table).tolist() == [max(-100, min(100, 6 * c)) for c in range(-8, 8)]


@pytest.mark.parametrize("dim", [-1, 1])
def test_softmax(dim):
    qx, xs, xz = act((2, 5, 13), scale=0.1)
    expected = Q.quantize(torch.softmax(Q.dequantize(qx, xs, xz), dim), 1 / 256, 0, "quint8")
    assert_close(ops.softmax(qx, xs, xz, dim, 1 / 256, 0), expected)


def test_cat_requantizes_only_what_differs():
    a, sa, za = act((2, 3, 4), scale=0.05, seed=1)
    b, sb, zb = act((2, 5, 4), scale=0.02, seed=2)
    out = ops.cat([a, b], [sa, sb], [za, zb], 1, sa, za)
    assert torch.equal(out[:, :3], a)  # same qparams: codes copied unchanged
    assert_close(out[:, 3:], Q.quantize(Q.dequantize(b, sb, zb), sa, za, "quint8"))
    assert torch.equal(ops.cat([a, a], [sa, sa], [za, za], 0, sa, za), torch.cat([a, a]))


@pytest.mark.parametrize("kernel,stride,padding,ceil_mode,include_pad", [
    ([3, 3], [2, 2], [1, 1], False, True), ([3, 3], [2, 2], [1, 1], True, False), ([2, 3], [], [0, 1], False, True)])
def test_avg_pool2d(kernel, stride, padding, ceil_mode, include_pad):
    qx, xs, xz = act((2, 3, 9, 7))
    y = F.avg_pool2d(Q.dequantize(qx, xs, xz), kernel, stride or None, padding, ceil_mode, include_pad)
    out = ops.avg_pool2d(qx, xs, xz, kernel, stride, padding, ceil_mode, include_pad, 0.03, 110)
    assert_close(out, Q.quantize(y, 0.03, 110, "quint8"))


@pytest.mark.parametrize("size", [[1, 1], [2, 3], [4, 4]])
def test_adaptive_avg_pool2d(size):
    qx, xs, xz = act((2, 5, 9, 7))
    y = F.adaptive_avg_pool2d(Q.dequantize(qx, xs, xz), size)
    assert_close(ops.adaptive_avg_pool2d(qx, xs, xz, size, 0.02, 120), Q.quantize(y, 0.02, 120, "quint8"))


@pytest.mark.parametrize("dim,keepdim", [([2, 3], True), ([-1], False), ([1], False)])
def test_mean(dim, keepdim):
    qx, xs, xz = act((2, 5, 9, 7))
    y = Q.dequantize(qx, xs, xz).mean(dim, keepdim)
    assert_close(ops.mean(qx, xs, xz, dim, keepdim, 0.01, 128), Q.quantize(y, 0.01, 128, "quint8"))


def test_bad_post_op_is_rejected():
    qa, sa, za = act((3,))
    with pytest.raises(ValueError, match="post_op"):
        ops.add(qa, sa, za, qa, sa, za, 0.1, 0, "gelu")


# ---- fake kernels: shape, dtype and strides of the real kernels, without computing ----


def _calls():
    qx, xs, xz = act((2, 3, 13))
    qw, ws = weight((7, 13))
    c2 = conv_args(CONV2D[1])
    c2cl = conv_args(CONV2D[2], channels_last=True)
    q4, s4, z4 = act((2, 6, 9, 7))
    other = act((2, 6, 4, 4))[0]
    return [
        ("quantize_per_tensor", (torch.randn(3, 5), 0.1, 3, -64, 63, torch.int8)),
        ("dequantize_per_tensor", (qx, xs, xz)),
        ("quantize_per_channel", (torch.randn(7, 13), ws, torch.zeros(7, dtype=torch.int64), 0, -64, 63, torch.int8)),
        ("dequantize_per_channel", (qw, ws, torch.zeros(7, dtype=torch.int64), 0)),
        ("linear", (qx, xs, xz, qw, ws, None, 0.1, 3, "relu", None)),
        ("linear", (qx, xs, xz, qw, ws, torch.randn(7), 0.1, 3, "none", torch.float32)),
        ("grouped_linear", (qx.reshape(6, 13), xs, xz, torch.randint(-64, 64, (3, 7, 13), dtype=torch.int8),
                            torch.rand(3, 7) * 0.01, torch.tensor([2, 2, 6]), 0.1, 3)),
        ("conv1d", (*act((2, 4, 17)), *weight((6, 2, 3)), None, [2], [1], [1], 2, 0.1, 3, "none", None)),
        ("conv2d", (*c2[:10], 0.1, 3, "relu", None)),
        ("conv2d", (*c2cl[:10], 0.1, 3, "none", torch.float32)),
        ("conv2d_add", (*c2[:10], other, 0.05, 9, 0.1, 3, "relu", None)),
        ("conv2d_add", (*c2cl[:10], act((1, 8, 1, 1))[0], 0.05, 9, 0.1, 3, "none", None)),
        ("add", (q4, s4, z4, q4[:1, :, :1], s4, z4, 0.1, 3, "none")),
        ("mul", (q4.contiguous(memory_format=torch.channels_last), s4, z4, q4, s4, z4, 0.1, 3, "relu")),
        ("matmul", (q4, s4, z4, q4.transpose(-1, -2), s4, z4, 0.1, 3)),
        ("lut", (q4, torch.arange(256, dtype=torch.uint8))),
        ("lut", (act((2, 8, 16, 16))[0].contiguous(memory_format=torch.channels_last), torch.arange(256, dtype=torch.uint8))),
        ("lut", (q4.transpose(1, 3), torch.arange(256, dtype=torch.uint8))),
        ("channel_lut", (q4, torch.randint(0, 256, (q4.shape[1], 256), dtype=torch.uint8), 1)),
        ("channel_lut", (act((2, 8, 5, 5))[0].contiguous(memory_format=torch.channels_last), torch.randn(8, 256), 1)),
        ("softmax", (q4, s4, z4, -1, 1 / 256, 0)),
        ("softmax", (q4.contiguous(memory_format=torch.channels_last), s4, z4, 1, 1 / 256, 0)),
        ("masked_softmax", (q4.transpose(1, 3), s4, z4, torch.rand(1, 1, 1, 6) < 0.3, float("-inf"), -1, 1 / 256, 0)),
        ("masked_softmax", (q4[:, :1], s4, z4, torch.randn(2, 6, 9, 7), None, -1, 1 / 256, 0)),
        ("softmax_matmul", (q4, s4, z4, None, None, q4.transpose(-1, -2), s4, z4, 0.1, 3)),
        ("softmax_matmul", (q4[:, :1], s4, z4, torch.rand(1, 6, 1, 7) < 0.3, float("-inf"), q4[:1, :, :7, :5], s4, z4, 0.1, 3)),
        ("probabilities_qdq", (torch.softmax(torch.randn(2, 6, 9), -1),)),
        ("cat", ([q4, q4], [s4, 0.5], [z4, z4], 1, s4, z4)),
        ("avg_pool2d", (q4, s4, z4, [3, 3], [2, 2], [1, 1], True, False, 0.1, 3)),
        ("adaptive_avg_pool2d", (q4.contiguous(memory_format=torch.channels_last), s4, z4, [1, 1], 0.1, 3)),
        ("mean", (q4, s4, z4, [2, 3], True, 0.1, 3)),
        ("max_pool2d", (q4.contiguous(memory_format=torch.channels_last), [3, 3], [2, 2], [1, 1], [1, 1], False)),
        ("layer_norm", (q4.transpose(1, 3), s4, z4, [6], torch.rand(6), torch.randn(6), 1e-5, 0.1, 3)),
        ("layer_norm", (qx, xs, xz, [3, 13], None, None, 1e-5, 0.1, 3)),
        ("rms_norm", (q4.transpose(1, 3), s4, z4, [6], torch.rand(6), 1e-6, 0.1, 3)),
        ("group_norm", (q4, s4, z4, 3, torch.rand(6), torch.randn(6), 1e-5, 0.1, 3)),
        ("group_norm", (act((2, 8, 5, 5))[0].contiguous(memory_format=torch.channels_last), s4, z4, 4, None, None, 1e-5, 0.1, 3)),
        ("group_norm", (q4.transpose(1, 3), s4, z4, 7, None, torch.randn(7), 1e-5, 0.1, 3)),
        ("group_norm", (qx, xs, xz, 1, None, None, 1e-5, 0.1, 3)),
    ]


@pytest.mark.parametrize("onednn", [True, False])
def test_fake_kernels_match_real_outputs(onednn):
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = _calls()
    assert {name for name, _ in calls} == set(K.library.OPS)
    with K.use_onednn(onednn):
        for name, args in calls:
            real = getattr(ops, name)(*args)
            # One mode per call, as torch.compile has one per compilation. A mode shared across
            # calls trips torch 2.9's FakeTensor memo: once the fake of a view (q4.transpose) is
            # gone, the memoized fake of its base (q4) reaches the next fake kernel as None
            # (reproduced on 2.9.1 with a plain torch.library op; fixed by 2.10).
            mode = FakeTensorMode()
            fake_args = [
                [mode.from_tensor(t) for t in a] if isinstance(a, list) and a and torch.is_tensor(a[0])
                else mode.from_tensor(a) if torch.is_tensor(a) else a
                for a in args
            ]
            with mode:
                fake = getattr(ops, name)(*fake_args)
            assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride()), name


@pytest.mark.parametrize("name", ["linear", "grouped_linear", "conv2d", "add", "lut"])
def test_opcheck(name):
    args = dict(_calls())[name]
    torch.library.opcheck(getattr(ops, name).default, args, test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("channels_last", [False, True])
def test_ops_compile_with_inductor(channels_last):
    qw, ws = weight((6, 3, 3, 3))
    qw2, ws2 = weight((6, 6, 3, 3), seed=4)
    fc, fs = weight((5, 6), seed=5)

    def block(x):
        q = ops.quantize_per_tensor(x, 0.05, 128, 0, 255, torch.uint8)
        y = ops.conv2d(q, 0.05, 128, qw, ws, None, [1, 1], [1, 1], [1, 1], 1, 0.04, 100, "relu", None)
        z = ops.conv2d_add(
            y, 0.04, 100, qw2, ws2, None, [1, 1], [1, 1], [1, 1], 1, y, 0.04, 100, 0.06, 90, "relu", None
        )
        pooled = ops.adaptive_avg_pool2d(z, 0.06, 90, [1, 1], 0.06, 90).flatten(1)
        return ops.linear(pooled, 0.06, 90, fc, fs, None, 1.0, 0, "none", torch.float32)

    x = torch.randn(2, 3, 8, 8)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="inductor", fullgraph=True)
    assert torch.equal(compiled(x), block(x))


@pytest.mark.parametrize("layout", ["nchw", "channels_last"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_max_pool2d_on_codes_matches_float_and_keeps_layout(layout, dtype):
    torch.manual_seed(0)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    q = torch.randint(lo, hi, (2, 5, 9, 11), dtype=torch.int16).to(dtype)
    if layout == "channels_last":
        q = q.contiguous(memory_format=torch.channels_last)
    out = torch.ops.lucid_fx.max_pool2d(q, [3, 3], [2, 2], [1, 1], [1, 1], False)
    expected = torch.nn.functional.max_pool2d(q.float(), 3, 2, 1).to(dtype)
    assert out.dtype == dtype and torch.equal(out, expected)
    assert out.is_contiguous(memory_format=torch.channels_last) == (layout == "channels_last")
    with torch._subclasses.FakeTensorMode():
        fake = torch.ops.lucid_fx.max_pool2d(torch.empty(2, 5, 9, 11, dtype=dtype), [3, 3], [2, 2], [1, 1], [1, 1], False)
    assert fake.shape == expected.shape and fake.dtype == dtype


@pytest.mark.parametrize("name", ["add", "mul", "matmul", "softmax", "lut"])
def test_reference_kernels_of_ops_with_cpu_kernels_agree_with_the_oracle(name):
    # CPU dispatches these to lucid_fx.kernels.cpu_float; the reference functions stay the kernels
    # of every other device (and CUDA's matmul), so they are checked here on their own.
    from lucid_fx.kernels import cpu_float, reference

    qa, sa, za = act((2, 3, 64, 32), scale=0.03, seed=1)
    qb, sb, zb = act((2, 3, 32, 64) if name == "matmul" else (2, 3, 64, 32), scale=0.02, seed=2)
    a, b = Q.dequantize(qa, sa, za), Q.dequantize(qb, sb, zb)
    if name == "lut":
        table = torch.randint(0, 256, (256,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
        args, expected = (qa, table), table[qa.to(torch.int64)]
    elif name == "softmax":
        args, expected = (qa, sa, za, -1, 1 / 256, 0), Q.quantize(torch.softmax(a, -1), 1 / 256, 0, "quint8")
    elif name == "matmul":
        args, expected = (qa, sa, za, qb, sb, zb, 0.05, 128), Q.quantize(a @ b, 0.05, 128, "quint8")
    else:
        y = a + b if name == "add" else a * b
        args, expected = (qa, sa, za, qb, sb, zb, 0.0811, 100, "none"), Q.quantize(y, 0.0811, 100, "quint8")
    for kernel in (getattr(reference, name), getattr(cpu_float, name), getattr(ops, name)):
        assert_close(kernel(*args), expected)


def test_convolution_packs_per_input_shape_up_to_a_bound():
    # Packed for the input shape, oneDNN picks its best weight layout; a weight seen at more than
    # SHAPED_PACKS shapes shares one generic pack for the rest, so memory stays bounded.
    qw, ws = weight((6, 4, 3, 3))
    with K.use_onednn(True):
        before = cpu.PACKED.builds
        for size in range(5, 5 + cpu.SHAPED_PACKS + 3):
            qx, xs, xz = act((1, 4, size, size), seed=size)
            expected = finish(F.conv2d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), None, 1, 1), "none", 0.06, 90, torch.uint8)
            assert_close(ops.conv2d(qx, xs, xz, qw, ws, None, [1, 1], [1, 1], [1, 1], 1, 0.06, 90, "none", None), expected)
        assert cpu.PACKED.builds - before == cpu.SHAPED_PACKS + 1  # one per shape up to the bound, then one generic
        ops.conv2d(act((1, 4, 5, 5))[0], xs, xz, qw, ws, None, [1, 1], [1, 1], [1, 1], 1, 0.06, 90, "none", None)
        assert cpu.PACKED.builds - before == cpu.SHAPED_PACKS + 1  # a shape seen before reuses its pack
