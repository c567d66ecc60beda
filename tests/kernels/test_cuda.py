"""CUDA kernels (torch._int_mm, padded) against float oracles computed on CPU."""

import pytest
import torch
import torch.nn.functional as F

import lucid_fx.kernels as K
import lucid_fx.quantization as Q
from lucid_fx.kernels import int_mm

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
ops = torch.ops.lucid_fx
DEV = torch.device("cuda")


def act(shape, seed=0, scale=0.0413, zp=117):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 2
    return Q.quantize(x, scale, zp, "quint8"), scale, zp


def weight(shape, seed=1):
    qmin, qmax = K.weight_quant_range(DEV)
    w = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    scale = w.abs().flatten(1).amax(1) / qmax
    codes = Q.quantize(w, scale, torch.zeros(shape[0], dtype=torch.int64), "qint8", ch_axis=0).clamp(qmin, qmax)
    return codes, scale


def deq_w(qw, ws):
    return Q.dequantize(qw, ws, torch.zeros_like(ws, dtype=torch.int64), ch_axis=0)


def assert_codes_close(out, expected):
    assert out.device.type == "cuda" and out.dtype == expected.dtype and out.shape == expected.shape
    diff = (out.cpu().int() - expected.int()).abs()
    assert diff.max().item() <= 1 and diff.sum().item() <= max(1, 0.02 * diff.numel())


def cu(*tensors):
    return [t.to(DEV) if torch.is_tensor(t) else t for t in tensors]


@pytest.mark.parametrize("shape", [(1, 13), (5, 13), (2, 3, 13), (64, 256)])
@pytest.mark.parametrize("post_op", ["none", "relu"])
def test_linear(shape, post_op):
    qx, xs, xz = act(shape)
    qw, ws = weight((7, shape[-1]))
    bias = torch.randn(7)
    y = F.linear(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias)
    y = y.relu() if post_op == "relu" else y
    gx, gw, gs, gb = cu(qx, qw, ws, bias)
    out = ops.linear(gx, xs, xz, gw, gs, gb, 0.0611, 100, post_op, None)
    assert_codes_close(out, Q.quantize(y, 0.0611, 100, "quint8"))
    as_float = ops.linear(gx, xs, xz, gw, gs, gb, 0.0611, 100, post_op, torch.float32)
    torch.testing.assert_close(as_float.cpu(), y, rtol=1e-5, atol=1e-4)


def test_linear_prepares_each_weight_once():
    qx, xs, xz = cu(*act((20, 32)))
    qw, ws = cu(*weight((16, 32)))
    before = int_mm.PREPARED.builds
    for _ in range(3):
        ops.linear(qx, xs, xz, qw, ws, None, 0.05, 100, "none", None)
    assert int_mm.PREPARED.builds == before + 1


@pytest.mark.parametrize(
    "n,c,h,o,k,s,p,g", [(1, 3, 9, 5, 3, 1, 1, 1), (2, 4, 8, 6, 3, 2, 1, 2), (1, 8, 10, 8, 3, 1, 1, 8)]
)
@pytest.mark.parametrize("channels_last", [False, True])
def test_conv2d(n, c, h, o, k, s, p, g, channels_last):
    qx, xs, xz = act((n, c, h, h + 1))
    qw, ws = weight((o, c // g, k, k))
    bias = torch.randn(o)
    y = F.conv2d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), bias, s, p, 1, g).relu()
    gx, gw, gs, gb = cu(qx, qw, ws, bias)
    if channels_last:
        gx = gx.contiguous(memory_format=torch.channels_last)
    out = ops.conv2d(gx, xs, xz, gw, gs, gb, [s, s], [p, p], [1, 1], g, 0.0577, 90, "relu", None)
    assert_codes_close(out, Q.quantize(y, 0.0577, 90, "quint8"))
    layout = torch.channels_last if channels_last else torch.contiguous_format
    assert out.is_contiguous(memory_format=layout)


def test_conv1d():
    qx, xs, xz = act((2, 4, 17))
    qw, ws = weight((6, 4, 3))
    y = F.conv1d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), None, 2, 1)
    gx, gw, gs = cu(qx, qw, ws)
    out = ops.conv1d(gx, xs, xz, gw, gs, None, [2], [1], [1], 1, 0.0577, 128, "none", None)
    assert_codes_close(out, Q.quantize(y, 0.0577, 128, "quint8"))


def test_conv2d_add():
    qx, xs, xz = act((2, 4, 8, 8))
    qw, ws = weight((6, 4, 3, 3))
    y = F.conv2d(Q.dequantize(qx, xs, xz), deq_w(qw, ws), None, 1, 1)
    qo, so, zo = act(y.shape, seed=3, scale=0.0519, zp=120)
    expected = Q.quantize((y + Q.dequantize(qo, so, zo)).relu(), 0.0811, 100, "quint8")
    gx, gw, gs, go = cu(qx, qw, ws, qo)
    out = ops.conv2d_add(gx, xs, xz, gw, gs, None, [1, 1], [1, 1], [1, 1], 1, go, so, zo, 0.0811, 100, "relu", None)
    assert_codes_close(out, expected)


@pytest.mark.parametrize("shapes", [((2, 3, 5, 13), (2, 3, 13, 7)), ((4, 17, 64), (4, 64, 17))])
def test_matmul(shapes):
    qa, sa, za = act(shapes[0], scale=0.0313)
    qb, sb, zb = act(shapes[1], seed=2, scale=0.0217)
    expected = Q.quantize(Q.dequantize(qa, sa, za) @ Q.dequantize(qb, sb, zb), 0.0731, 128, "quint8")
    ga, gb = cu(qa, qb)
    assert_codes_close(ops.matmul(ga, sa, za, gb, sb, zb, 0.0731, 128), expected)


def test_elementwise_ops_run_on_cuda():
    qa, sa, za = act((2, 3, 4, 5))
    qb, sb, zb = act((1, 3, 1, 1), seed=2, scale=0.0517)
    expected = Q.quantize(Q.dequantize(qa, sa, za) + Q.dequantize(qb, sb, zb), 0.0811, 100, "quint8")
    ga, gb = cu(qa, qb)
    assert_codes_close(ops.add(ga, sa, za, gb, sb, zb, 0.0811, 100, "none"), expected)
    table = K.make_lut(torch.sigmoid, sa, za, (0, 255), 1 / 256, 0, (0, 255))
    expected = Q.quantize(torch.sigmoid(Q.dequantize(qa, sa, za)), 1 / 256, 0, "quint8")
    assert torch.equal(ops.lut(ga, table.to(DEV)).cpu(), expected)


def test_softmax_matmul_and_the_gelu_post_op_run_on_cuda():
    # attention's fused softmax(s) @ v (the reference kernel on the device) within a step of the CPU kernel
    qs, ss, zs = act((2, 4, 16, 40), seed=3, scale=0.05)
    qv, sv, zv = act((2, 4, 40, 8), seed=4, scale=0.03)
    mask = torch.rand(2, 1, 1, 40, generator=torch.Generator().manual_seed(5)) < 0.3
    args = (ss, zs, mask, float("-inf"))
    cpu = ops.softmax_matmul(qs, *args, qv, sv, zv, 0.02, 120)
    gq, gv = cu(qs, qv)
    gpu = ops.softmax_matmul(gq, ss, zs, mask.to(DEV), float("-inf"), gv, sv, zv, 0.02, 120)
    assert_codes_close(gpu, cpu)
    qx, xs, xz = act((16, 32))
    qw, ws = weight((24, 32))
    y = F.gelu(F.linear(Q.dequantize(qx, xs, xz), deq_w(qw, ws)))
    gx, gw, gs = cu(qx, qw, ws)
    assert_codes_close(ops.linear(gx, xs, xz, gw, gs, None, 0.02, 10, "gelu", None), Q.quantize(y, 0.02, 10, "quint8"))
