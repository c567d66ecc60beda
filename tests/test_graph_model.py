"""to_networkx: the graph model of prepared, converted and reference graphs."""

import networkx as nx
import pytest
import torch
from torch import nn

import lucid_fx


class Gate(nn.Module):
    """linear -> neg -> tanh -> (t+1)/2 gates a Softmin branch (``ln``); softmax head. Softmin has no int8
    rule, so it runs in float (LayerNorm did, before it had a kernel). The tanh reads a negation, so
    ``tanh(-l1) + 1`` is one table of l1's codes on the fixed [0, 2] grid (rules/one_source.py): straight after
    the linear a tanh would be the linear's post-op (rules/lowering_gate.py)."""

    def __init__(self):
        super().__init__()
        self.l1, self.ln, self.l2 = nn.Linear(16, 16), nn.Softmin(dim=-1), nn.Linear(16, 4)

    def forward(self, x):
        g = (torch.tanh(-self.l1(x)) + 1) / 2
        return torch.softmax(self.l2(self.ln(x) * g), -1)


@pytest.fixture(scope="module")
def calibrated():
    torch.manual_seed(0)
    model = Gate().eval()
    data = [torch.randn(8, 16) for _ in range(4)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)
    return model, prepared, data


def test_prepared_graph_folds_observers_and_carries_decisions(calibrated):
    _, prepared, _ = calibrated
    g = lucid_fx.to_networkx(prepared)
    assert list(g.nodes) == ["x", "l1", "neg", "tanh", "add", "truediv", "ln", "mul", "l2", "softmax", "output"]
    assert ("truediv", "mul") in g.edges and ("ln", "mul") in g.edges and ("x", "ln") in g.edges
    tanh, div, l1 = g.nodes["tanh"], g.nodes["truediv"], g.nodes["l1"]
    assert (tanh["domain"], tanh["observer"], tanh["qparams"], tanh["interval"]) == (
        "fixed", "FixedQParamsObserver", "scale=0.0078125 zp=128", "[-1, 1]"
    )
    assert div["domain"] == "fixed" and div["interval"] == "[0, 1]" and "ranges.py" in div["interval_rule"]
    scale, zp = prepared.lucid_fx_observers[prepared.graph.find_nodes(op="call_module", target="l1")[0].meta["lucid_fx.observer"]].calculate_qparams()
    assert l1["domain"] == "int8" and l1["scale"] == pytest.approx(float(scale)) and l1["zero_point"] == int(zp)
    assert l1["weight_observer"] == "PerChannelMinMaxObserver"
    assert l1["op"] == "linear" and l1["shape"] == "8x16" and l1["dtype"] == "float32" and l1["rule"]
    assert g.nodes["x"]["domain"] == "io" and g.nodes["output"]["domain"] == "io"


def test_converted_graph_has_domains_grids_and_shapes(calibrated):
    _, prepared, _ = calibrated
    q = lucid_fx.convert(prepared)
    g = lucid_fx.to_networkx(q)
    by_source = {}
    for name, attrs in g.nodes(data=True):
        by_source.setdefault(attrs.get("source"), []).append(attrs)
    lut = [a for a in by_source["add"] if a.get("lowering") == "add"][0]  # tanh(-l1) + 1 on [0, 2]
    assert lut["domain"] == "fixed" and lut["dtype"] == "uint8" and lut["shape"] == "8x16"
    assert (lut["scale"], lut["zero_point"]) == (2 / 256, 0) and "tanh" not in by_source and "neg" not in by_source
    ln = [a for a in by_source["ln"] if a["fx_op"] == "call_module"][0]
    assert ln["domain"] == "float" and ln["dtype"] == "float32"
    boundaries = sorted(a["op"] for a in g.nodes.values() if a["domain"] == "boundary")
    assert boundaries == ["dequantize_per_tensor", "quantize_per_tensor", "quantize_per_tensor"]
    linear = [a for a in by_source["l1"] if a.get("lowering") == "linear"][0]
    assert linear["domain"] == "int8" and "_lucid_l1_qweight" in linear["constants"]
    assert not any("qweight" in n for n in g.nodes)  # weights are folded into their consumers
    with_consts = lucid_fx.to_networkx(q, constants=True)
    assert with_consts.nodes["_lucid_l1_qweight"]["domain"] == "const"
    assert with_consts.number_of_nodes() > g.number_of_nodes()


def test_reference_graph_marks_its_quantize_pairs(calibrated):
    _, prepared, _ = calibrated
    ref = lucid_fx.convert(prepared, reference=True)
    g = lucid_fx.to_networkx(ref)
    quants = [a for a in g.nodes.values() if a["op"] == "quantize_per_tensor"]
    assert {a["source"] for a in quants} >= {"x", "l1", "add", "softmax"} and "tanh" not in {a["source"] for a in quants}
    assert all(a["domain"] == "boundary" and "scale" in a for a in quants)


def test_graphml_round_trip_keeps_every_attribute(calibrated, tmp_path):
    _, prepared, _ = calibrated
    g = lucid_fx.to_networkx(prepared)
    path = tmp_path / "g.graphml"
    nx.write_graphml(g, path)
    back = nx.read_graphml(path)
    assert list(back.nodes) == list(g.nodes) and set(back.edges) == set(g.edges)
    assert back.nodes["tanh"] == g.nodes["tanh"]


def test_models_prepared_in_parts_get_prefixed_names():
    class Untraceable(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Sequential(nn.Linear(4, 2), nn.Sigmoid())

        def forward(self, x):
            if x.sum() > 0:  # data-dependent: the root cannot be traced
                return self.b(self.a(x))
            return self.b(self.a(-x))

    prepared = lucid_fx.prepare(Untraceable().eval(), example_inputs=(torch.randn(2, 4),))
    g = lucid_fx.to_networkx(prepared)
    assert {"a._0", "a._1", "b._0", "b._1"} <= set(g.nodes)
    assert g.nodes["b._1"]["graph"] == "b" and g.nodes["b._1"]["domain"] == "fixed"


def test_bad_input_is_named():
    with pytest.raises(TypeError, match="expects an nn.Module.*got Tensor"):
        lucid_fx.to_networkx(torch.zeros(1))
    with pytest.raises(ValueError, match="Linear holds no torch.fx GraphModule: pass the result of lucid_fx.prepare"):
        lucid_fx.to_networkx(nn.Linear(2, 2))


def test_layer_norm_is_float_in_every_view(calibrated, tmp_path):
    # Before: the prepared graph called ln "int8" (it has an observer: int8 mul reads it) and so
    # did compare; the converted graph and the convert report called it float.
    model, prepared, data = calibrated
    q = lucid_fx.convert(prepared)
    before, after = lucid_fx.to_networkx(prepared), lucid_fx.to_networkx(q)
    expected = ("float", "float", "no lowering rule for ln")
    assert tuple(before.nodes["ln"][k] for k in ("domain", "runs", "runs_why")) == expected
    ln = [a for a in after.nodes.values() if a.get("source") == "ln" and a["fx_op"] == "call_module"][0]
    assert tuple(ln[k] for k in ("domain", "runs", "runs_why")) == expected
    assert q.lucid_fx_convert_report.float_ops == {"ln": "no lowering rule for ln"}
    row = lucid_fx.compare(model, q, data).by_node()["ln"]
    assert (row.domain, row.runs) == ("float", "float") and row.sqnr_db > 30
    # The tanh table and the x / 2 that only rescales the grid are int8 in every view too.
    assert (before.nodes["tanh"]["runs"], before.nodes["truediv"]["runs"]) == ("table lookup", "shared codes")
    page = lucid_fx.visualize(q, tmp_path / "q.html", layout="layered").read_text()
    assert '"runs": "table lookup", "runs_why": "add"' in page and '"runs_why": "no lowering rule for ln"' in page
