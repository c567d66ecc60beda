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
    assert (report.lowered, report.float_ops) == ({"_1": "conv2d"}, {})  # the batch norm folded into the conv (keyed by its value, the bn)


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


# -- conv padding modes -------------------------------------------------------------------------

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


@pytest.mark.parametrize("mode", PADDING_MODES)
@pytest.mark.parametrize("dims", [1, 2])
def test_conv_padding_mode_is_lowered_exactly(mode, dims, sqnr_db):
    conv = (nn.Conv1d if dims == 1 else nn.Conv2d)(3, 8, 3, padding=2, padding_mode=mode)
    shape = (8, 3, 12) if dims == 1 else (8, 3, 12, 12)
    torch.manual_seed(0)
    model = nn.Sequential(conv).eval()
    prepared, qmodel = _quantize(model, shape)
    x = torch.randn(*shape)
    with torch.no_grad():
        got = qmodel(x)
        assert sqnr_db(model(x), got) >= MIN_SQNR  # 5.1-14.4 dB before: lowered as zero padding
        # int8 exactly as the simulated model (zero padding in the kernel, the others on the codes)
        reference = lucid_fx.convert(prepared, reference=True)(x)
    # the conv gives its float result, in the simulation too: equal but for the order of float sums
    out_scale = float(prepared.lucid_fx_observers["_0"].calculate_qparams()[0])
    print(f"max |int8 - reference| {float((got - reference).abs().max()) / out_scale:.2g} output steps")
    assert (got - reference).abs().max() <= out_scale * 1e-3  # borders included
    report = qmodel.lucid_fx_convert_report
    assert (report.lowered, report.float_ops) == ({"_0": f"conv{dims}d"}, {})
    assert ("torch.nn.functional.pad(" in qmodel.code) == (mode != "zeros")


class PadThenConv(nn.Module):
    def __init__(self, mode):
        super().__init__()
        self.conv, self.mode = nn.Conv2d(3, 8, 3), mode

    def forward(self, x):
        return self.conv(F.pad(x, (1, 2, 2, 1), mode=self.mode))


@pytest.mark.parametrize("mode", ["constant", "reflect", "replicate", "circular"])
def test_functional_pad_then_conv_gives_the_float_answer(mode, sqnr_db):
    torch.manual_seed(0)
    model = PadThenConv(mode).eval()
    _, qmodel = _quantize(model, (8, 3, 12, 12))
    x = torch.randn(8, 3, 12, 12)
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) >= MIN_SQNR
    # F.pad moves the input's codes (a zero is the zero point), then the conv
    assert qmodel.lucid_fx_convert_report.lowered == {"pad": "shared", "conv": "conv2d"}


# -- layout at the float boundary ---------------------------------------------------------------

class ConvThen(nn.Module):
    """A conv (its int8 codes are channels-last inside the converted model) and then ``tail``."""

    def __init__(self, tail, cin=3, kernel=3):
        super().__init__()
        self.conv, self.tail = nn.Conv2d(cin, 8, kernel, padding=1 if kernel == 3 else 0), tail

    def forward(self, x):
        return self.tail(self.conv(x))


TAILS = {
    "view(n, -1)": lambda y: y.view(y.size(0), -1),
    "flatten": lambda y: torch.flatten(y, 1),
    "reshape": lambda y: y.reshape(-1, 8 * 10 * 10),
    "permute": lambda y: y.permute(0, 2, 3, 1),
    "transpose+view": lambda y: y.transpose(2, 3).contiguous().view(y.size(0), 8, -1),
    "same": lambda y: y,
    "relu": torch.relu,
    "float op": lambda y: torch.cumsum(y, dim=3),
}


@pytest.mark.parametrize("name", sorted(TAILS))
def test_values_leaving_int8_have_the_float_models_layout(name, sqnr_db):
    torch.manual_seed(0)
    model = ConvThen(TAILS[name]).eval()
    _, qmodel = _quantize(model, (4, 3, 10, 10))
    x = torch.randn(4, 3, 10, 10)
    with torch.no_grad():
        want, got = model(x), qmodel(x)  # view(n, -1) raised "view size is not compatible" before
    assert sqnr_db(want, got) >= MIN_SQNR
    assert (got.shape, got.stride(), got.is_contiguous()) == (want.shape, want.stride(), want.is_contiguous())


def test_strides_read_in_the_graph_are_the_float_models():
    model = ConvThen(lambda y: (y.is_contiguous(), y.stride())).eval()
    _, qmodel = _quantize(model, (4, 3, 10, 10))
    x = torch.randn(4, 3, 10, 10)
    assert qmodel(x) == model(x) == (True, (800, 100, 10, 1))  # was (False, (800, 1, 80, 8))


def test_a_1x1_output_has_the_float_models_strides(sqnr_db):
    # (N, C, 1, 1) is contiguous in both layouts, with different strides in the size-1 dims
    model = ConvThen(lambda y: y, kernel=10).eval()
    _, qmodel = _quantize(model, (4, 3, 10, 10))
    x = torch.randn(4, 3, 10, 10)
    with torch.no_grad():
        want, got = model(x), qmodel(x)
    assert sqnr_db(want, got) >= MIN_SQNR
    assert (got.shape, got.stride()) == (want.shape, want.stride()) == ((4, 8, 1, 1), (8, 1, 1, 1))


def test_a_channels_last_model_stays_channels_last(sqnr_db):
    model = ConvThen(torch.relu).eval()
    torch.manual_seed(0)
    data = [torch.randn(4, 3, 10, 10).contiguous(memory_format=torch.channels_last) for _ in range(8)]
    qmodel = lucid_fx.quantize(model, (data[0],), data)
    x = torch.randn(4, 3, 10, 10).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        want, got = model(x), qmodel(x)
    assert sqnr_db(want, got) >= MIN_SQNR
    assert got.stride() == want.stride() == (800, 1, 80, 8)
    assert "contiguous_format" not in qmodel.code  # no layout change anywhere


@pytest.mark.parametrize("dims", [1, 2])
def test_an_unbatched_conv_input_is_lowered(dims, sqnr_db):
    conv = nn.Conv1d(3, 8, 3, padding=1, padding_mode="reflect") if dims == 1 else nn.Conv2d(3, 8, 3, padding=1)
    model = nn.Sequential(conv, nn.ReLU()).eval()
    shape = (3, 64) if dims == 1 else (3, 16, 16)  # no batch dim: (C, L) and (C, H, W)
    _, qmodel = _quantize(model, shape)
    x = torch.randn(*shape)
    with torch.no_grad():
        want, got = model(x), qmodel(x)  # raised before: "required rank 4 tensor to use channels_last format"
    assert sqnr_db(want, got) >= MIN_SQNR
    assert (got.shape, got.stride()) == (want.shape, want.stride())
    assert qmodel.lucid_fx_convert_report.lowered == {"_1": f"conv{dims}d+relu"}


def test_an_unbatched_residual_block_is_lowered(sqnr_db):
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv1, self.conv2 = nn.Conv2d(3, 3, 3, padding=1), nn.Conv2d(3, 3, 3, padding=1)

        def forward(self, x):
            y = torch.relu(self.conv1(x))
            return torch.relu(self.conv2(y) + y)

    model = Block().eval()
    _, qmodel = _quantize(model, (3, 10, 10))
    x = torch.randn(3, 10, 10)
    with torch.no_grad():
        want, got = model(x), qmodel(x)
    assert sqnr_db(want, got) >= MIN_SQNR and got.stride() == want.stride()
    assert sorted(qmodel.lucid_fx_convert_report.lowered.values()) == ["conv2d+add+relu", "conv2d+relu"]


# -- a user's leaf named like an op -----------------------------------------------------------------

class DoubledLinear(nn.Module):
    """A leaf whose weight means what its forward does with it: an ``nn.Linear`` lowering of it reads the raw
    weight and drops the doubling."""

    def __init__(self):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(16, 16) * 0.3), nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return F.linear(x, self.weight * 2, self.bias)


def softmax(x):  # a leaf function named like torch's, computing something else
    return x * 2


torch.fx.wrap("softmax")  # one call node, as a leaf


@pytest.mark.parametrize("leaf", ["module", "function"])
def test_a_leaf_named_like_an_op_is_not_lowered_as_that_op(leaf, sqnr_db):
    # A module at ``self.linear`` or a function called ``softmax`` that no spelling knows once got the canonical op
    # of that name: convert lowered the module as an nn.Linear (its raw weight) and the function as a softmax
    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.linear, self.out = nn.Linear(16, 16), DoubledLinear(), nn.Linear(16, 8)

        def forward(self, x):
            h = self.fc(x)
            return self.out(self.linear(h) if leaf == "module" else softmax(h))

    torch.manual_seed(0)
    model, data = Model().eval(), [torch.randn(32, 16) for _ in range(4)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],), leaf_modules=[DoubledLinear])
    lucid_fx.calibrate(prepared, data, progress=False)
    qmodel = lucid_fx.convert(prepared)
    with torch.no_grad():
        x = torch.randn(32, 16)
        assert sqnr_db(model(x), qmodel(x)) >= MIN_SQNR
    name = "DoubledLinear:linear" if leaf == "module" else f"{__name__}.softmax"
    assert f"no lowering rule for {name}" in str(qmodel.lucid_fx_convert_report), str(qmodel.lucid_fx_convert_report)


# -- what these fixes put in a converted graph can be saved ---------------------------------------

def test_converted_models_with_these_fixes_save_and_load():
    import io

    cases = [  # in place kept (mul_, getitem, view_as), F.pad on codes, unbatched (unsqueeze/squeeze), layout restore (clone)
        (ViewMutation(), (128, 16)),
        (OnInput(), (128, 16)),
        (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular")), (4, 3, 12, 12)),
        (nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU()), (3, 16, 16)),
        (ConvThen(TAILS["view(n, -1)"], kernel=10), (4, 3, 10, 10)),
        (SharedConv(), (4, 4, 10, 10)),
    ]
    for model, shape in cases:
        for reference in (False, True):
            _, qmodel = _quantize(model.eval(), shape, batches=2, reference=reference)
            buffer = io.BytesIO()
            lucid_fx.save(qmodel, buffer)
            buffer.seek(0)
            loaded = lucid_fx.load(buffer)
            x = torch.randn(*shape)
            with torch.no_grad():
                assert torch.equal(loaded(x.clone()), qmodel(x.clone())), (type(model).__name__, reference)
