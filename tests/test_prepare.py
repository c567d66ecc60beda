"""prepare end to end: every bounded spelling gets exact fixed qparams; outputs stay bit-exact."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
import lucid_fx.quantization as Q


class EverySpelling(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.sig, self.sm, self.tanh, self.hs, self.r6 = nn.Sigmoid(), nn.Softmax(dim=1), nn.Tanh(), nn.Hardsigmoid(), nn.ReLU6()

    def forward(self, x):
        z = self.fc(x)
        return (
            self.sig(z), torch.sigmoid(z), F.sigmoid(z), z.sigmoid(),  # [0, 1]
            self.sm(z), F.softmax(z, dim=1), torch.softmax(z, 0), z.softmax(-1),  # [0, 1]
            self.tanh(z), torch.tanh(z), z.tanh(), F.tanh(z),  # [-1, 1]
            self.hs(z), F.hardsigmoid(z),  # [0, 1]
            self.r6(z), F.relu6(z), F.hardtanh(z, 0.0, 6.0),  # [0, 6]
            (torch.tanh(z) + 1) / 2, 1 - torch.sigmoid(z), F.relu6(z) / 6,  # composites: [0, 1]
        )


UNIT = ["sig", "sigmoid", "sigmoid_1", "sigmoid_2", "sm", "softmax", "softmax_1", "softmax_2", "hs", "hardsigmoid", "truediv", "sub", "truediv_1"]
SYMMETRIC = ["tanh", "tanh_1", "tanh_2", "tanh_3"]
SIX = ["r6", "relu6", "hardtanh"]


def _mapping(qdtype):
    act = Q.MinMaxObserver.with_args(qdtype=qdtype)
    return Q.QConfigMapping().set_global(Q.QConfig(act, Q.PerChannelMinMaxObserver.with_args()))


@pytest.mark.parametrize(
    "qdtype, unit, symmetric, six",
    [
        (Q.quint8, (1 / 256, 0), (2 / 256, 128), (6 / 256, 0)),
        (Q.qint8, (1 / 256, -128), (2 / 256, 0), (6 / 256, -128)),
    ],
)
def test_every_spelling_gets_exact_fixed_qparams(qdtype, unit, symmetric, six):
    model = EverySpelling().eval()
    prepared = lucid_fx.prepare(model, _mapping(qdtype), example_inputs=(torch.randn(4, 6),))
    observers = prepared.lucid_fx_observers
    for names, expected in ((UNIT, unit), (SYMMETRIC, symmetric), (SIX, six)):
        for name in names:
            obs = observers[name]
            assert isinstance(obs, Q.FixedQParamsObserver), name
            assert obs.qdtype is qdtype
            assert (obs.scale.item(), obs.zero_point.item()) == expected, name
    assert isinstance(observers["fc"], Q.MinMaxObserver)


def test_calibrated_outputs_equal_float_bit_for_bit_and_input_untouched():
    torch.manual_seed(0)
    model = EverySpelling().eval()
    snapshot = copy.deepcopy(model.state_dict())
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(4, 6),))
    lucid_fx.calibrate(prepared, [torch.randn(4, 6) for _ in range(3)], progress=False)
    x = torch.randn(5, 6)
    for got, want in zip(prepared(x), model(x)):
        assert torch.equal(got, want)
    assert all(torch.equal(v, snapshot[k]) for k, v in model.state_dict().items())
    assert not hasattr(model, "lucid_fx_observers")
    keys = prepared.state_dict().keys()
    assert "lucid_fx_observers.fc.histogram" in keys and "lucid_fx_observers.sig.scale" in keys
    assert "lucid_fx_weight_observers.fc.min_val" in keys


def test_inplace_modifies_the_given_graph_module():
    gm = torch.fx.symbolic_trace(nn.Sequential(nn.Linear(2, 2)).eval())
    out = lucid_fx.prepare(gm, inplace=True)
    assert out is gm and hasattr(gm, "lucid_fx_observers")


def test_range_analysis_can_be_turned_off_per_type_and_qconfig_none_keeps_float():
    no_ranges = Q.QConfig(Q.MinMaxObserver.with_args(), Q.PerChannelMinMaxObserver.with_args(), range_analysis=False)
    mapping = Q.get_default_qconfig_mapping().set_object_type(torch.tanh, no_ranges).set_object_type(nn.Sigmoid, None)
    prepared = lucid_fx.prepare(EverySpelling().eval(), mapping, example_inputs=(torch.randn(2, 6),))
    rows = lucid_fx.explain(prepared).by_node()
    # every tanh spelling follows the torch.tanh key: canonical matching
    assert [rows[n]["kind"] for n in SYMMETRIC] == ["statistics"] * 4
    assert rows["tanh"]["observer"] == "MinMaxObserver"
    # nn.Sigmoid -> None: every sigmoid spelling stays float
    assert [rows[n]["kind"] for n in ("sig", "sigmoid", "sigmoid_1", "sigmoid_2")] == ["float"] * 4
    assert rows["softmax"]["kind"] == "fixed"


def test_explain_names_rule_and_reason():
    prepared = lucid_fx.prepare(EverySpelling().eval(), example_inputs=(torch.randn(2, 6),))
    table = lucid_fx.explain(prepared)
    row = table.by_node()["truediv"]
    assert row["op"] == "div" and row["spelling"] == "operator.truediv"
    assert row["qparams"] == "[0, 1] scale=0.00390625 zp=0"
    assert row["kind"] == "fixed" and row["reason"] == "output proven in [0, 1]"  # the interval that chose the grid
    assert "lucid_fx/rules/observers.py:" in row["rule"] and "lucid_fx/rules/ranges.py:" in row["rule"]
    text = str(table)
    assert text.splitlines()[0].split()[:4] == ["node", "op", "spelling", "kind"]
    # 20 outputs plus the four inner bounded nodes of the composites; x and fc are observed by statistics
    assert table.summary() == "fixed: 24, statistics: 2"


def test_calibrate_progress_bar_and_batch_forms(capsys):
    import io

    class TwoInputs(nn.Module):
        def forward(self, a, b):
            return torch.sigmoid(a + b)

    prepared = lucid_fx.prepare(TwoInputs().eval(), example_inputs=(torch.randn(2), torch.randn(2)))
    stream = io.StringIO()
    n = lucid_fx.calibrate(prepared, [(torch.randn(2), torch.randn(2)), {"a": torch.randn(2), "b": torch.randn(2)}], progress=True, stream=stream)
    assert n == 2
    assert "[########################] 2/2" in stream.getvalue()
    with pytest.raises(ValueError, match="calibration data was empty"):
        lucid_fx.calibrate(prepared, [], progress=False)


def test_bad_input_is_explained():
    with pytest.raises(TypeError, match="prepare expects an nn.Module"):
        lucid_fx.prepare(lambda x: x)
    with pytest.raises(ValueError, match="model is in training mode; call model.eval"):
        lucid_fx.prepare(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown backend 'tpu'; valid: cpu, cuda"):
        lucid_fx.prepare(nn.Linear(2, 2).eval(), backend="tpu")
    with pytest.raises(ValueError, match="example_inputs do not run through the model"):
        lucid_fx.prepare(nn.Linear(2, 2).eval(), example_inputs=(torch.randn(3, 5),))


def test_integer_inputs_stay_unquantized():
    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb, self.fc = nn.Embedding(10, 4), nn.Linear(4, 2)

        def forward(self, ids):
            return self.fc(self.emb(ids))

    prepared = lucid_fx.prepare(Embed().eval(), example_inputs=(torch.tensor([[1, 2, 3]]),))
    rows = lucid_fx.explain(prepared).by_node()
    assert rows["ids"]["kind"] == "none" and rows["ids"]["reason"] == "not a float tensor"
    assert rows["emb"]["kind"] == "statistics"  # float output read by a quantized linear


def test_prepare_qat_uses_fake_quant_and_trains():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 3), nn.Sigmoid())
    prepared = lucid_fx.prepare_qat(model, example_inputs=(torch.randn(2, 4),))
    obs = prepared.lucid_fx_observers
    assert isinstance(obs["_1"], Q.FakeQuantize) and isinstance(obs["_3"], Q.FixedQParamsFakeQuantize)
    assert torch.nn.utils.parametrize.is_parametrized(prepared.get_submodule("0"), "weight")
    opt = torch.optim.SGD(prepared.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.rand(16, 3)
    losses = []
    for _ in range(20):
        loss = F.mse_loss(prepared(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0]
    with pytest.raises(ValueError, match="model is in eval mode; call model.train"):
        lucid_fx.prepare_qat(model.eval())


def test_reference_framework_names():
    prepared = Q.prepare_qat_fx(nn.Sequential(nn.Linear(2, 2), nn.Tanh()), None, (torch.randn(3, 2),))
    assert isinstance(prepared.lucid_fx_observers["_1"], Q.FixedQParamsFakeQuantize)
    prepared = Q.prepare_fx(nn.Sequential(nn.Linear(2, 2)).eval(), None, (torch.randn(3, 2),))
    assert isinstance(prepared.lucid_fx_observers["_0"], Q.HistogramObserver)


def test_a_compiled_module_is_unwrapped_and_calibration_feeds_its_observers():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)).eval()
    compiled = torch.compile(model)
    with pytest.warns(UserWarning, match=r"prepare: got a torch.compile'd module \(OptimizedModule\); quantizing the module it wraps \(model._orig_mod, a Sequential\)"):
        prepared = lucid_fx.prepare(compiled, example_inputs=(torch.randn(2, 4),))
    assert isinstance(prepared, torch.fx.GraphModule)
    batch = torch.full((2, 4), 3.0)
    lucid_fx.calibrate(prepared, [batch], progress=False)
    observed = prepared.lucid_fx_observers["input_1"]
    assert (float(observed.min_val), float(observed.max_val)) == (3.0, 3.0)  # the observers saw the batch
    qmodel = lucid_fx.convert(prepared)
    assert str(qmodel.lucid_fx_convert_report).startswith("backend cpu: 2 int8 kernels")


def test_prepare_takes_example_inputs_second_with_a_warning_that_names_the_order():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    x, mapping = torch.randn(2, 4), Q.get_default_qconfig_mapping()
    expected = sorted(lucid_fx.prepare(model, mapping, (x,)).lucid_fx_observers)  # torch.ao's order, silent
    for args in [((x,),), ((x,), mapping), (x,)]:
        with pytest.warns(UserWarning, match=r"prepare: took the (tuple|Tensor) given second as example_inputs\. prepare's positional order is torch.ao's, prepare\(model, qconfig_mapping, example_inputs\); pass them by keyword"):
            prepared = lucid_fx.prepare(model, *args)
        assert sorted(prepared.lucid_fx_observers) == expected == ["_1", "input_1"]


def test_explain_rule_paths_are_modules_of_the_installed_package():
    import importlib.util

    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2), nn.Sigmoid()).eval()
    table = lucid_fx.explain(lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4),)))
    cited = {row["rule"].split(":")[0] for row in table.by_node().values() if row["rule"]}
    assert "lucid_fx/passes/choose_observers.py" in cited  # the input sweep
    for path in cited:
        assert path.startswith("lucid_fx/") and path.endswith(".py"), path
        spec = importlib.util.find_spec(path[: -len(".py")].replace("/", "."))
        assert spec is not None and spec.origin.endswith(path.rpartition("/")[2]), path
