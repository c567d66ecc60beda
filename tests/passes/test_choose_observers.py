"""choose_observers (with insert_observers after it): the graph before and after, and shared observers."""

import torch
from torch import nn

import lucid_fx
import lucid_fx.quantization as Q
from lucid_fx import _meta
from lucid_fx.passes.analyze_ranges import analyze_ranges
from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.choose_observers import choose_observers
from lucid_fx.passes.fuse_patterns import fuse_patterns
from lucid_fx.passes.insert_observers import insert_observers
from lucid_fx.passes.propagate_shapes import propagate_shapes
from lucid_fx.passes.trace_model import trace_model


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.pool = nn.MaxPool1d(2)

    def forward(self, x):
        y = self.pool(torch.relu(self.fc(x)))
        return torch.sigmoid(y)


def _annotated(registry):
    x = torch.randn(2, 3, 4)
    gm = trace_model(Small().eval()).graph_module
    propagate_shapes(gm, (x,))
    for step in (canonicalize_ops, fuse_patterns, analyze_ranges):
        step(gm, registry)
    return gm, x


def _body(gm):
    return [line.strip() for line in gm.code.strip().splitlines()[1:]]


def test_graph_before_and_after(registry):
    gm, x = _annotated(registry)
    assert _body(gm) == [
        "fc = self.fc(x);  x = None",
        "relu = torch.relu(fc);  fc = None",
        "pool = self.pool(relu);  relu = None",
        "sigmoid = torch.sigmoid(pool);  pool = None",
        "return sigmoid",
    ]
    choose_observers(gm, registry, Q.QConfigMapping().set_global(Q.minmax_qconfig))
    kinds = {n.name: n.meta[_meta.DECISION].kind.value for n in gm.graph.nodes if n.op != "output"}
    assert kinds == {"x": "statistics", "fc": "fused", "relu": "statistics", "pool": "shared", "sigmoid": "fixed"}
    expected_out = gm(x)
    insert_observers(gm)
    assert _body(gm) == [
        "lucid_fx_observers_x = self.lucid_fx_observers.x(x);  x = None",
        "fc = self.fc(lucid_fx_observers_x);  lucid_fx_observers_x = None",
        "relu = torch.relu(fc);  fc = None",
        "lucid_fx_observers_relu = self.lucid_fx_observers.relu(relu);  relu = None",
        "pool = self.pool(lucid_fx_observers_relu);  lucid_fx_observers_relu = None",
        "lucid_fx_observers_relu_1 = self.lucid_fx_observers.relu(pool);  pool = None",
        "sigmoid = torch.sigmoid(lucid_fx_observers_relu_1);  lucid_fx_observers_relu_1 = None",
        "lucid_fx_observers_sigmoid = self.lucid_fx_observers.sigmoid(sigmoid);  sigmoid = None",
        "return lucid_fx_observers_sigmoid",
    ]
    # pool shares relu's observer: one module, called twice
    assert set(gm.lucid_fx_observers.keys()) == {"x", "relu", "sigmoid"}
    assert isinstance(gm.lucid_fx_observers["sigmoid"], Q.FixedQParamsObserver)
    assert isinstance(gm.lucid_fx_weight_observers["fc"], Q.PerChannelMinMaxObserver)
    assert gm.lucid_fx_weight_observers["fc"].min_val.shape == (4,)
    assert torch.equal(gm(x), expected_out)


def test_shapes_are_recorded(registry):
    gm, _ = _annotated(registry)
    shapes = {n.name: tuple(n.meta[_meta.TENSOR_META].shape) for n in gm.graph.nodes if n.op != "output"}
    assert shapes == {"x": (2, 3, 4), "fc": (2, 3, 4), "relu": (2, 3, 4), "pool": (2, 3, 2), "sigmoid": (2, 3, 2)}


def test_a_fused_group_takes_its_weighted_ops_qconfig():
    """set_module_name on a linear followed by a functional relu governs the whole fused group."""
    import lucid_fx
    from lucid_fx.quantization import QConfigMapping, default_qconfig, minmax_qconfig

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

        def forward(self, x):
            return self.head(torch.relu(self.proj(x)))

    x = torch.randn(2, 4)
    rows = lucid_fx.explain(lucid_fx.prepare(Net().eval(), QConfigMapping().set_global(minmax_qconfig).set_module_name("proj", default_qconfig), (x,))).by_node()
    assert rows["proj"]["kind"] == "fused" and rows["relu"]["observer"] == "HistogramObserver"
    assert rows["head"]["observer"] == "MinMaxObserver"
    floated = lucid_fx.prepare(Net().eval(), QConfigMapping().set_global(default_qconfig).set_module_name("proj", None), (x,))
    rows = lucid_fx.explain(floated).by_node()
    assert rows["proj"]["kind"] == "float"  # not fused into an int8 kernel against the user's None
    assert rows["relu"]["kind"] == "statistics" and "input of quantized head" in rows["relu"]["reason"]


def test_a_linear_batch_norm_group_is_observed_at_its_end_only_where_it_folds():
    """bn(linear(x)) folds at convert only on a 2-D value (the norm is over dim 1, the linear's
    features are the last dim), so only there does the group's end get an observer of its own."""
    import lucid_fx

    for shape, kind in (((8, 4), "statistics"), ((8, 3, 4), "float")):
        model = nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).eval()
        prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(*shape),))
        rows = lucid_fx.explain(prepared).by_node()
        assert (rows["_0"]["kind"], rows["_1"]["kind"]) == ("fused", kind), shape
        assert ("_1" in prepared.lucid_fx_observers) == (kind == "statistics")


class ScaledByAnArgument(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, scale: float = 2.0):
        return self.fc(x) * scale


def test_a_number_input_with_example_inputs_gets_no_observer_and_converts():
    # Before: with shapes recorded, `scale` (a float default) was taken for a float tensor and
    # observed; convert then said its observer "saw no data; run lucid_fx.calibrate" after calibrate.
    torch.manual_seed(0)
    model, x = ScaledByAnArgument().eval(), torch.randn(4, 8)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    scale = next(n for n in prepared.graph.nodes if n.op == "placeholder" and n.name == "scale")
    assert scale.meta[_meta.DECISION].kind.value == "none"
    lucid_fx.calibrate(prepared, [x, 2 * x], progress=False)
    q = lucid_fx.convert(prepared)
    for s in (2.0, 3.0):
        torch.testing.assert_close(q(x, s), model(x, s), atol=0.1, rtol=0.05)
