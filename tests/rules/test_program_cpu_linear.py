"""The CPU program rules for linears (lucid_fx/rules/program_cpu_linear.py): a linear with a float
result read once by a residual add runs as oneDNN's linear with its "add" post-op, and the program's
output is the portable graph's, bit for bit; what the fusion does not take keeps the add."""

import operator

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels import cpu as onednn
from lucid_fx.rules import program_cpu_linear
from _program import called, lowered, operands

ON = torch.ops.onednn


class Residual(nn.Module):
    """``x + fc2(relu(fc1(x)))`` (or the sum the other way round), the float stream of a transformer block;
    ``also`` reads the projection a second time."""

    def __init__(self, d: int = 64, swap: bool = False, also: bool = False, bias_only: bool = False):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
        self.swap, self.also, self.bias_only = swap, also, bias_only

    def forward(self, x):
        y = self.fc2(self.fc1(x).relu())
        r = x[0, 0] if self.bias_only else x  # a broadcast residual: not the projection's shape
        out = y + r if self.swap else r + y
        return out * y if self.also else out


@pytest.fixture
def onednn_linear(monkeypatch):
    """Every linear on oneDNN's prepacked linear, as on a VNNI CPU: not its 1x1 convolution (CPUs
    without VNNI) nor a row engine (small linears), whichever this CPU is."""
    if not onednn.onednn_available():
        pytest.skip("oneDNN's int8 linear is not available in this torch build")
    monkeypatch.setattr(onednn, "_linear_as_conv", lambda: False)
    monkeypatch.setattr(program_cpu_linear, "_engine", lambda *args, **kwargs: None)


def _program(model, x):
    torch.manual_seed(0)
    q = lucid_fx.quantize(model.eval(), (x,), [x, 2 * torch.randn_like(x), torch.randn_like(x)])
    return lowered(q, x)


@pytest.mark.parametrize("swap", [False, True], ids=["r + linear", "linear + r"])
def test_a_residual_add_is_the_linear_s_post_op_with_the_portable_output(onednn_linear, swap):
    x = torch.randn(2, 24, 64)
    out, program, calls = _program(Residual(swap=swap), x)
    assert torch.equal(program(x), out)
    assert calls.count(ON.qlinear_pointwise.binary) == 1 and calls.count(ON.qlinear_pointwise.default) == 1
    assert torch.add not in calls and operator.add not in calls
    (fused,) = [operands(n) for n in program.graph.nodes if called(n) is ON.qlinear_pointwise.binary]
    assert fused[13] == "add" and fused[10] is torch.float32  # the post-op, a float32 result


@pytest.mark.parametrize("case", ["read twice", "broadcast residual"])
def test_what_the_fusion_does_not_take_keeps_the_add(onednn_linear, case):
    x = torch.randn(2, 24, 64)
    model = Residual(also=case == "read twice", bias_only=case == "broadcast residual")
    out, program, calls = _program(model, x)
    assert torch.equal(program(x), out)
    assert ON.qlinear_pointwise.binary not in calls and calls.count(ON.qlinear_pointwise.default) == 2
    assert calls.count(operator.add) + calls.count(torch.add) == 1
