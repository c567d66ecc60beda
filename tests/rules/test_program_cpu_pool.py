"""The CPU program rules for pools (lucid_fx/rules/program_cpu_pool.py) and the image quantize before a
convolution (lucid_fx/rules/program_cpu_elementwise.py): a program's max pool gives the portable
graph's codes exactly, its average pool is within one code of them, and both run native_pool.c
where the native kernels are loaded; an image is quantized straight to channels-last codes."""

import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels import native, native_elementwise, native_pool, program_ops
from lucid_fx.kernels.library import op_name
from _program import lowered


class Stem(nn.Module):
    """ResNet's stem: conv -> relu -> 3x3/2 max pool, then a convolution and ``pool``."""

    def __init__(self, pool: nn.Module):
        super().__init__()
        self.conv, self.pool_max = nn.Conv2d(3, 16, 3, padding=1), nn.MaxPool2d(3, 2, 1)
        self.mix, self.pool = nn.Conv2d(16, 24, 1), pool

    def forward(self, x):
        return self.pool(self.mix(self.pool_max(self.conv(x).relu())))


def _lowered(model, x):
    torch.manual_seed(0)
    q = lucid_fx.quantize(model.eval(), (x,), [x, 2 * torch.randn_like(x), torch.randn_like(x)])
    return (q, *lowered(q, x))


def test_a_max_pool_and_the_image_quantize_run_natively_with_the_portable_codes():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, 17)
    q, out, program, calls = _lowered(Stem(nn.MaxPool2d(2)), x)
    assert torch.equal(program(x), out)
    assert [op_name(n) for n in q.graph.nodes].count("max_pool2d") == 2
    if native.available():  # the rerun with LUCID_FX_NATIVE=0 (tests/test_every_cpu_kind.py) checks the torch route
        assert calls.count(native_pool.pool_codes) == 2 and program_ops.max_pool_taps not in calls
        assert calls[0] is native_elementwise.quantize_channels_last
    else:
        assert calls.count(program_ops.max_pool_taps) == 2 and native_pool.pool_codes not in calls


def test_an_average_pool_runs_natively_within_one_code():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, 17)
    pool = nn.AvgPool2d(3, stride=2, padding=1, count_include_pad=False)
    q, out, program, calls = _lowered(Stem(pool), x)
    (node,) = [n for n in q.graph.nodes if op_name(n) == "avg_pool2d"]
    out_scale = node.args[8]
    got = program(x)
    assert got.shape == out.shape and float((got - out).abs().max()) <= out_scale * 1.0001
    assert (native_pool.pool_codes in calls) == native.available()


def test_an_average_pool_in_ceil_mode_keeps_the_reference_kernel():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 17, 17)
    q, out, program, calls = _lowered(Stem(nn.AvgPool2d(2, ceil_mode=True)), x)
    assert torch.equal(program(x), out)
    assert calls.count(native_pool.pool_codes) == (1 if native.available() else 0)  # the max pool only
