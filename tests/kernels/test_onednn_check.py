"""lucid_fx/kernels/onednn_check.py: oneDNN's convolutions checked once per pack where its AMX kernels run, a pack
that disagrees left for the exact fallback. The first test meets the real fault on an AMX CPU (and passes on the
others, where oneDNN is right); the rest force the check on every machine."""

import pytest
import torch

import lucid_fx
from lucid_fx.kernels import cpu, onednn_check
from lucid_fx.kernels import reference as ref
from lucid_fx.kernels.cpu_features import detected_cpu_features
from _grid import onednn_exact
from _program import lowered
from lucid_fx.kernels import resolve_target

ops = torch.ops.lucid_fx

pytestmark = pytest.mark.skipif(not cpu.onednn_available(), reason="this torch build has no oneDNN quantized ops")


def _conv_case(seed, channels, out, groups, kernel, length, padding=0):
    g = torch.Generator().manual_seed(seed)
    two_d = isinstance(kernel, tuple)
    shape = (2, channels, 6, length) if two_d else (2, channels, length)
    qx = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    low, high = resolve_target("cpu").weight_range  # the grid this CPU's kernels take (AVX2's narrow one warns else)
    qw = torch.randint(low, high + 1, (out, channels // groups, *(kernel if two_d else (kernel,))), dtype=torch.int8,
                       generator=g)
    ws, bias = torch.rand(out, generator=g) * 0.01 + 0.001, torch.randn(out, generator=g)
    dims = 2 if two_d else 1
    return qx, qw, ws, bias, [1] * dims, [padding] * dims, [1] * dims


# Measured wrong (up to 255 codes) on an AMX Xeon with torch 2.13's oneDNN: 16 channels a group by a kernel 8 wide, 8 by
# 16, 4 by 32, and wav2vec 2.0's positional convolution (64 channels in 4 groups, kernel 16, padding 8).
AMX_FAULTS = [(16, 16, 1, 8, 64, 0), (16, 16, 2, 16, 100, 0), (8, 8, 1, 16, 64, 0), (4, 4, 1, 32, 80, 0),
              (64, 64, 4, 16, 159, 8), (16, 16, 1, (1, 8), 24, 0)]


@pytest.mark.parametrize("channels, out, groups, kernel, length, padding", AMX_FAULTS)
def test_a_convolution_onednn_gets_wrong_on_amx_gives_the_reference_codes(channels, out, groups, kernel, length, padding):
    qx, qw, ws, bias, stride, pad, dilation = _conv_case(length, channels, out, groups, kernel, length, padding)
    op, reference = (ops.conv2d, ref.conv2d) if qx.dim() == 4 else (ops.conv1d, ref.conv1d)
    args = (qx, 0.02, 3, qw, ws, bias, stride, pad, dilation, groups, 0.05, 128, "none", torch.uint8)
    got, want = op(*args), reference(*args)
    assert got.shape == want.shape
    assert int((got.int() - want.int()).abs().max()) <= 1  # oneDNN's float rounding against the reference's
    assert onednn_check.checked_here() == detected_cpu_features().amx


def test_the_check_runs_only_where_onednn_runs_its_amx_kernels(monkeypatch):
    monkeypatch.setattr(onednn_check, "checked_here", lambda: False)
    monkeypatch.setattr(onednn_check, "_onednn_conv", lambda *a: pytest.fail("no probe where nothing is checked"))
    qx, qw, ws, _, stride, pad, dilation = _conv_case(0, 16, 16, 1, 8, 64)
    assert onednn_check.conv_agrees(torch.empty(0), qw, ws, qx.shape, stride, pad, dilation, 1)


@pytest.mark.parametrize("kernel", [3, (3, 3)])
def test_a_right_pack_passes_the_check(kernel, monkeypatch):
    monkeypatch.setattr(onednn_check, "checked_here", lambda: True)
    qx, qw, ws, _, stride, pad, dilation = _conv_case(1, 32, 48, 1, kernel, 40, 1)
    packed = torch.ops.onednn.qconv_prepack(qw, ws, 1.0, 0, stride, pad, dilation, 1, list(qx.shape))
    assert onednn_check.conv_agrees(packed, qw, ws, qx.shape, stride, pad, dilation, 1)
    real = onednn_check._onednn_conv

    def one_output_off(*args):
        y = real(*args)
        y.view(-1)[7] += 1.0
        return y
    monkeypatch.setattr(onednn_check, "_onednn_conv", one_output_off)
    assert not onednn_check.conv_agrees(packed, qw, ws, qx.shape, stride, pad, dilation, 1)


def _off_by_one(monkeypatch):
    """oneDNN as the AMX fault: every result one unit off, where the check is forced on."""
    real = onednn_check._onednn_conv
    monkeypatch.setattr(onednn_check, "checked_here", lambda: True)
    monkeypatch.setattr(onednn_check, "_onednn_conv", lambda *a: real(*a) + 1.0)


def test_a_pack_that_fails_the_check_runs_on_the_exact_fallback(monkeypatch):
    _off_by_one(monkeypatch)
    calls = []
    real_fallback = cpu.int8_conv
    monkeypatch.setattr(cpu, "int8_conv", lambda *a, **k: calls.append(a[3].shape) or real_fallback(*a, **k))
    qx, qw, ws, bias, stride, pad, dilation = _conv_case(2, 32, 32, 1, (3, 3), 20, 1)
    args = (qx, 0.02, 3, qw, ws, bias, stride, pad, dilation, 1, 0.05, 128, "none", torch.uint8)
    got = ops.conv2d(*args)
    assert calls == [qw.shape]
    assert int((got.int() - ref.conv2d(*args).int()).abs().max()) <= 1


def test_a_program_keeps_the_portable_call_where_the_pack_fails_the_check(monkeypatch):
    if not onednn_exact(resolve_target("cpu")):
        pytest.skip("a VNNI kind forced on an AVX2 CPU: its full-grid weights never reach oneDNN (the exact fallback)")
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 24, 3, padding=1), torch.nn.ReLU()).eval()
    x = torch.randn(1, 16, 12, 12)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    lucid_fx.calibrate(prepared, [x])
    qmodel = lucid_fx.convert(prepared)
    from lucid_fx.rules import program_cpu
    monkeypatch.setattr(program_cpu, "_engine", lambda *args: None)  # oneDNN's convolution, not lucid_fx's kernels
    monkeypatch.setattr(program_cpu.conv_native, "amx_conv_engine", lambda *args: (None, None))
    _, _, right = lowered(qmodel, x)
    assert torch.ops.onednn.qconv2d_pointwise.default in right
    _off_by_one(monkeypatch)
    portable, program, targets = lowered(qmodel, x)
    assert torch.ops.onednn.qconv2d_pointwise.default not in targets
    assert torch.equal(program(x), portable)  # the portable call, on its own route
