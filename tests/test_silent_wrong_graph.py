"""No silent wrong results from the graph passes (issue 11, section 2): in-place ops, conv padding
modes, shared batch-norm folding, and layouts at the float boundary. Each case gives the float
model's answer within int8 error (SQNR against float >= 30 dB), or stays float and says so."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx

MIN_SQNR = 30.0


def _quantize(model, shape, batches=8, seed=0, **kw):
    torch.manual_seed(seed)
    data = [torch.randn(*shape) for _ in range(batches)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0].clone(),))
    lucid_fx.calibrate(prepared, [d.clone() for d in data], progress=False)
    return prepared, lucid_fx.convert(prepared, **kw)


# -- in-place ops used only through mutation ---------------------------------------------------

class Mutates(nn.Module):
    """``step(h)`` changes ``h`` (in place, result ignored) or returns the new value (out of place)."""

    def __init__(self, step):
        super().__init__()
        self.fc1, self.fc2, self.step = nn.Linear(16, 16), nn.Linear(16, 8), step

    def forward(self, x):
        h = self.fc1(x)
        new = self.step(h)
        return self.fc2(h if new is None else new)


def _ignore(value):
    return None


IN_PLACE = {  # in-place spelling (result ignored) -> the same op out of place
    "clamp_": (lambda h: _ignore(h.clamp_(0, 0.1)), lambda h: h.clamp(0, 0.1)),
    "torch.relu_": (lambda h: _ignore(torch.relu_(h)), lambda h: torch.relu(h)),
    "mul_": (lambda h: _ignore(h.mul_(2)), lambda h: h.mul(2)),
    "add_": (lambda h: _ignore(h.add_(1)), lambda h: h.add(1)),
    "sigmoid_": (lambda h: _ignore(h.sigmoid_()), lambda h: torch.sigmoid(h)),
    "F.relu(inplace=True)": (lambda h: _ignore(F.relu(h, inplace=True)), lambda h: F.relu(h)),
}


@pytest.mark.parametrize("name", sorted(IN_PLACE))
def test_in_place_op_used_only_through_mutation_is_converted(name, sqnr_db):
    in_place, out_of_place = IN_PLACE[name]
    torch.manual_seed(0)
    model = Mutates(in_place).eval()
    twin = Mutates(out_of_place).eval()
    twin.load_state_dict(model.state_dict())
    prepared, qmodel = _quantize(model, (128, 16))
    twin_prepared, twin_q = _quantize(twin, (128, 16))
    # The same observers and qparams as the out-of-place spelling, fixed ones included (sigmoid_, clamp_) ...
    rows = [(r["op"], r["kind"], r["observer"], r["qparams"]) for r in lucid_fx.explain(prepared).rows]
    assert rows == [(r["op"], r["kind"], r["observer"], r["qparams"]) for r in lucid_fx.explain(twin_prepared).rows]
    assert qmodel.lucid_fx_convert_report.float_ops == {}
    x = torch.randn(64, 16)
    with torch.no_grad():
        expected = model(x.clone())
        got = qmodel(x.clone())
        assert sqnr_db(expected, got) >= MIN_SQNR
        assert torch.equal(got, twin_q(x.clone()))  # ... so exactly what that spelling converts to
        assert torch.equal(prepared(x.clone()), expected)  # and prepare stays exact


def test_in_place_bounded_ops_get_the_fixed_qparams_of_their_out_of_place_spelling():
    for in_place, op, (lo, hi) in (("sigmoid_", "sigmoid", (0.0, 1.0)), ("clamp_", "clamp", (0.0, 0.1))):
        prepared, _ = _quantize(Mutates(IN_PLACE[in_place][0]).eval(), (128, 16))
        row = lucid_fx.explain(prepared).by_node()[in_place]
        assert (row["op"], row["kind"], row["observer"]) == (op, "fixed", "FixedQParamsObserver")
        assert row["qparams"] == f"[{lo:g}, {hi:g}] scale={(hi - lo) / 256:.6g} zp=0"


class OnInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        x.mul_(2)
        return self.fc(x)


def test_in_place_op_on_the_model_input_runs_in_float_and_is_reported(sqnr_db):
    model = OnInput().eval()
    _, qmodel = _quantize(model, (128, 16))
    x = torch.randn(64, 16)
    caller_x = x.clone()
    with torch.no_grad():
        expected = model(x.clone())
        got = qmodel(caller_x)
    assert sqnr_db(expected, got) >= MIN_SQNR
    torch.testing.assert_close(caller_x, x * 2, rtol=0, atol=0)  # the caller sees the change, as with the float model
    assert qmodel.lucid_fx_convert_report.float_ops == {"mul_": "changes model input 'x' in place, which the caller sees"}
    assert "float: mul_ (changes model input 'x' in place" in str(qmodel.lucid_fx_convert_report)


class ViewMutation(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 16), nn.Linear(16, 8)

    def forward(self, x):
        h = self.fc1(x)
        h[:, :8].sigmoid_()  # changes half of h through a view
        return self.fc2(h)


def test_in_place_op_through_a_view_stays_float_with_its_views_and_is_reported(sqnr_db):
    model = ViewMutation().eval()
    _, qmodel = _quantize(model, (128, 16))
    x = torch.randn(64, 16)
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) >= MIN_SQNR
    report = qmodel.lucid_fx_convert_report
    assert sorted(report.float_ops) == ["getitem", "sigmoid_", "view_as"]
    assert report.float_ops["sigmoid_"] == "changes 'getitem' in place, and 'fc1' shares its storage and is read afterwards"
    assert sorted(report.lowered) == ["fc1", "fc2"]


def test_prepare_does_not_change_the_users_in_place_modules(sqnr_db):
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.relu, self.fc2 = nn.Linear(16, 16), nn.ReLU(inplace=True), nn.Linear(16, 8)

        def forward(self, x):
            h = self.fc1(x)
            self.relu(h)
            return self.fc2(h)

    model = Net().eval()
    _, qmodel = _quantize(model, (128, 16))
    assert model.relu.inplace is True
    x = torch.randn(64, 16)
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) >= MIN_SQNR
    assert qmodel.lucid_fx_convert_report.lowered == {"relu": "linear+relu", "fc2": "linear"}


# -- batch-norm folding -------------------------------------------------------------------------

def _randomise(bn):
    with torch.no_grad():
        bn.running_mean.uniform_(-2, 2)
        bn.running_var.uniform_(0.2, 3)
        bn.weight.uniform_(0.5, 2)
        bn.bias.uniform_(-1, 1)
    return bn


class SharedConv(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(4, 8, 3, padding=1), _randomise(nn.BatchNorm2d(8)), _randomise(nn.BatchNorm2d(8))

    def forward(self, x):
        # the same conv: with one batch norm, with another, and with none
        return self.bn1(self.conv(x)) + self.bn2(self.conv(x)) * self.conv(x)


@pytest.mark.parametrize("reference", [False, True])
def test_a_conv_shared_between_call_sites_keeps_each_sites_answer(reference, sqnr_db):
    torch.manual_seed(0)
    model = SharedConv().eval()
    _, qmodel = _quantize(model, (4, 4, 10, 10), reference=reference)
    x = torch.randn(4, 4, 10, 10)
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) >= MIN_SQNR  # 3.2 dB before: every call got bn1 folded in


def test_conv_bn_at_the_models_output_is_int8(sqnr_db):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(4, 8, 3), _randomise(nn.BatchNorm2d(8))).eval()
    with torch.no_grad():
        model[1].running_var[3] = 0.0  # a dead channel: folded with eps, never NaN
    _, qmodel = _quantize(model, (4, 4, 10, 10))
    x = torch.randn(4, 4, 10, 10)
    with torch.no_grad():
        got = qmodel(x)
        assert not got.isnan().any() and sqnr_db(model(x), got) >= MIN_SQNR
    report = qmodel.lucid_fx_convert_report  # was "0 int8 kernels, 0 ops in float": all of it silently float
    assert (report.lowered, report.float_ops) == ({"_0": "conv2d"}, {})  # the batch norm folded into the conv


def test_linear_bn1d_on_a_3d_value_stays_float_and_says_why():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), _randomise(nn.BatchNorm1d(4))).eval()
    _, qmodel = _quantize(model, (8, 4, 4))
    x = torch.randn(8, 4, 4)
    with torch.no_grad():
        torch.testing.assert_close(qmodel(x), model(x), rtol=0, atol=0)
    assert qmodel.lucid_fx_convert_report.float_ops == {
        "_1": "batch norm not folded: it normalises dim 1 of _0's 3-D output, not the linear's output features; runs in float"
    }
