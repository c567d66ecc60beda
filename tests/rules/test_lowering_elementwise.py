"""Elementwise ops on codes (lucid_fx/rules/lowering_elementwise.py): any activation of one int8 input is a
256-entry table of the op evaluated on every code; a PReLU with a slope per channel is a table per channel."""

import operator
import warnings

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels.library import op_name

ACTIVATIONS = {  # modules whose op is a table (rules/observers.py's statistics rule, lowering's lower_elementwise)
    "mish": nn.Mish(), "softplus": nn.Softplus(beta=2.0), "selu": nn.SELU(), "celu": nn.CELU(0.5),
    "logsigmoid": nn.LogSigmoid(), "tanhshrink": nn.Tanhshrink(), "softshrink": nn.Softshrink(0.3),
    "prelu-one-slope": nn.PReLU(),
}


def _conv_act_conv(act):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), act, nn.Conv2d(8, 4, 1)).eval()


def _quantized(model, shape=(2, 3, 12, 12)):
    batches = [torch.randn(shape) for _ in range(4)]
    return lucid_fx.quantize(model, (batches[0],), batches, progress=False)


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_an_activation_module_is_one_table_on_the_codes(name, sqnr_db):
    model = _conv_act_conv(ACTIVATIONS[name])
    q = _quantized(model)
    assert [op_name(n) for n in q.graph.nodes].count("lut") == 1 and q.lucid_fx_convert_report.float_ops == {}
    with torch.no_grad():
        x = torch.randn(2, 3, 12, 12)
        assert sqnr_db(model(x), q(x)) >= 30


def test_a_prelu_with_a_slope_per_channel_is_a_table_per_channel(sqnr_db):
    prelu = nn.PReLU(8)
    with torch.no_grad():
        prelu.weight.copy_(torch.linspace(-0.5, 0.9, 8))  # slopes of both signs, each channel its own
    model = _conv_act_conv(prelu)
    q = _quantized(model)
    [lookup] = [n for n in q.graph.nodes if op_name(n) == "channel_lut"]
    tables = getattr(q, lookup.args[1].target)
    assert tables.shape == (8, 256) and lookup.args[2] == 1 and q.lucid_fx_convert_report.float_ops == {}
    assert not torch.equal(tables[0], tables[7])  # slope -0.5 and 0.9 on the same codes
    with torch.no_grad():
        x = torch.randn(2, 3, 12, 12)
        assert sqnr_db(model(x), q(x)) >= 30


@pytest.mark.parametrize("act", [nn.Hardshrink(0.3), nn.Threshold(0.1, -1.0)], ids=["hardshrink", "threshold"])
def test_an_activation_with_a_jump_stays_float(act, sqnr_db):
    # an input rounded across the jump lands on the other side of it; float reads the convolution's float result and
    # only its output is rounded (measured here: 29.6 against 27.0 dB as a table, 23.0 against 21.6)
    model = _conv_act_conv(act)
    q = _quantized(model)
    assert list(q.lucid_fx_convert_report.float_ops) == ["_1"] and "lut" not in [op_name(n) for n in q.graph.nodes]
    with torch.no_grad():
        x = torch.randn(2, 3, 12, 12)
        assert sqnr_db(model(x), q(x)) >= 20


class MaxFeatureMap(nn.Module):
    """LightCNN's Max-Feature-Map (torch.max of a conv's two halves), a minimum of two linears broadcast against
    a row, and torch.max over a dim (PointNet's global feature) and over everything."""

    def __init__(self):
        super().__init__()
        self.conv, self.a, self.b, self.head = nn.Conv2d(3, 16, 3, padding=1), nn.Linear(8, 8), nn.Linear(8, 1), nn.Linear(8, 4)

    def forward(self, x):
        top, bottom = self.conv(x).split(8, 1)
        h = torch.max(top, bottom).mean((2, 3))  # (2, 8)
        m = torch.minimum(self.a(h), self.b(h))  # (2, 8) against (2, 1)
        return self.head(m + torch.max(m, 1, keepdim=True)[0] + torch.max(m))


def test_a_max_or_min_of_two_values_is_the_max_of_their_codes_on_the_output_grid(sqnr_db):
    torch.manual_seed(0)
    model = MaxFeatureMap().eval()
    batches = [torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel, reference = lucid_fx.convert(prepared), lucid_fx.convert(prepared, reference=True)
    lowered = qmodel.lucid_fx_convert_report.lowered
    assert [lowered[n] for n in ("max_1", "minimum", "getitem", "max_3")] == ["maximum", "minimum", "shared", "shared"], lowered
    targets = [n.target for n in qmodel.graph.nodes]
    # the conv's halves share its grid: the max of their codes as they lie, then one table; the linears' two grids:
    # each onto the output's grid, then the min
    assert targets.count(torch.ops.lucid_fx.lut) == 3 and targets.count(torch.maximum) == 1 and targets.count(torch.minimum) == 1
    maximum = next(n for n in qmodel.graph.nodes if n.target is torch.maximum)
    assert [a.target for a in maximum.args] == [operator.getitem] * 2 and list(maximum.users)[0].target is torch.ops.lucid_fx.lut
    x = batches[0]
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 30
        assert sqnr_db(reference(x), qmodel(x)) > 45  # rounding keeps order: the reference's max, code for code


class LearnedTemperature(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.temperature = nn.Linear(8, 8), nn.Parameter(torch.tensor(0.07))

    def forward(self, x):
        return torch.softmax(self.fc(x) / self.temperature, -1)


def test_a_division_by_a_learned_temperature_rescales_the_grid_without_a_warning():
    torch.manual_seed(0)
    batches = [torch.randn(4, 8) for _ in range(4)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        qmodel = lucid_fx.quantize(LearnedTemperature().eval(), (batches[0],), batches, progress=False)
    assert [str(w.message) for w in caught] == []  # was torch's "Converting a tensor with requires_grad=True to a scalar"
    assert qmodel.lucid_fx_convert_report.placements["truediv"].runs.value == "shared codes"  # the codes, on a grid / 0.07
