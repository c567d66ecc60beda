"""lucid_fx/computed_weights.py: a weight the model computes from its parameters (``F.linear(x, self.w * self.g)``,
``F.normalize(self.w)``) is computed once at convert and quantized per channel as the layer's weight, where the
layer ran in float ("lowering declined") and the computation ran as int8 activations on every call."""

import torch
import torch.nn.functional as F
from torch import fx, nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.computed_weights import PER_CALL_WHY, from_parameters, parameter_value
from lucid_fx.explain import explain
from lucid_fx.kernels.target import resolve_target
from lucid_fx.node_refs import unstable_name
from lucid_fx.quantization.weight import quantize_layer_weight
from lucid_fx.rules.observers import DecisionKind


class WeightNormed(nn.Module):
    """A weight-normalised layer written by hand (direction times gain), then a noisy one."""

    def __init__(self):
        super().__init__()
        self.v, self.g = nn.Parameter(torch.randn(24, 16)), nn.Parameter(torch.rand(24, 1) + 0.5)
        self.head = nn.Linear(24, 8)

    def forward(self, x):
        h = torch.relu(F.linear(x, F.normalize(self.v, dim=1) * self.g))
        return self.head(h) + F.linear(h, self.head.weight + torch.randn_like(self.head.weight) * 0, None)


def _batches(n=6):
    return [torch.randn(8, 16, generator=torch.Generator().manual_seed(s)) for s in range(n)]


def test_what_counts_as_computed_from_parameters():
    gm = fx.symbolic_trace(WeightNormed())
    nodes = {n.name: n for n in gm.graph.nodes}
    assert from_parameters(nodes["mul"]) and torch.allclose(parameter_value(nodes["mul"]), F.normalize(gm.v, dim=1) * gm.g)
    assert not from_parameters(nodes["randn_like"]) and not from_parameters(nodes["add"])  # random: differs per call
    assert not from_parameters(nodes["linear"]) and parameter_value(nodes["x"]) is None  # reads the input
    assert [n for n in ("normalize", "normal_", "randn_like", "dropout2d", "empty_like", "layer_norm") if unstable_name(n)] \
        == ["normal_", "randn_like", "dropout2d", "empty_like"]


def test_a_buffer_the_graph_writes_is_no_weight():
    class Cache(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w", torch.randn(4, 4))

        def forward(self, x):
            self.w.mul_(0.5)
            return F.linear(x, self.w.t())

    exported = lucid_fx.prepare(Cache().eval(), example_inputs=(torch.randn(2, 4),))  # torch.export records the write
    weight = next(n for n in exported.graph.nodes if n.op == "get_attr" and n.target == "w")
    assert not from_parameters(weight) and not from_parameters(next(iter(weight.users)))


def test_a_computed_weight_is_quantized_once_per_channel(sqnr_db):
    torch.manual_seed(0)
    model = WeightNormed().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(_batches(1)[0],))
    decisions = {n.name: n.meta[_meta.DECISION] for n in prepared.graph.nodes if _meta.DECISION in n.meta}
    for name in ("normalize", "mul"):
        assert decisions[name].kind is DecisionKind.NONE and decisions[name].reason.startswith("a weight computed from parameters")
    lucid_fx.calibrate(prepared, _batches(), progress=False)
    qmodel = lucid_fx.convert(prepared)
    report = qmodel.lucid_fx_convert_report
    assert report.lowered["relu"] == "linear+relu" and report.int8_flop_share > 0.5, str(report)
    assert report.float_ops["linear_1"] == PER_CALL_WHY  # was "lowering declined"
    predicted = {name: (row["runs"], row["runs_why"]) for name, row in explain(prepared).by_node().items() if row["runs"]}
    assert predicted == {name: (p.runs.value, p.why) for name, p in report.placements.items()}  # explain agrees
    weight = F.normalize(model.v, dim=1) * model.g
    codes, _ = quantize_layer_weight(weight, None, resolve_target("cpu"))
    assert torch.equal(qmodel._lucid_linear_qweight, codes)
    x = _batches(1)[0]
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 35
        assert sqnr_db(lucid_fx.convert(prepared, reference=True)(x), qmodel(x)) > 40
