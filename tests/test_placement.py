"""placement: one answer to "where does each op run, and why", read by all five reports."""

import json
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.placement import Placement, Runs, placements
from lucid_fx.quantization import get_default_qconfig_mapping


class Mixed(nn.Module):
    """Every decision kind: a fused conv+BN+ReLU group, shared ops on codes (max-pool, reshape), a
    shape query, statistics ops lowered to kernels (linear, a * b), a fixed-qparams sigmoid and a
    gelu lowered to tables, x * 0.5 on a rescaled grid, a Hardshrink in float (no int8 rule), and a linear that
    the QConfigMapping keeps float."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn, self.relu = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU()
        self.pool = nn.MaxPool2d(2)
        self.fc1, self.ln, self.fc2, self.fc3 = nn.Linear(128, 16), nn.Hardshrink(), nn.Linear(16, 16), nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        h = self.pool(self.relu(self.bn(self.conv(x))))
        h = h.reshape(h.size(0), -1)
        h = self.fc1(h)
        g = torch.sigmoid(h)
        h = self.fc2(F.gelu(self.ln(h) * g))  # a gelu after a linear would be its fused post-op
        h = self.fc3(h) * 0.5
        return self.head(h)


K, T, S, FL, NT = Runs.KERNEL, Runs.TABLE, Runs.SHARED, Runs.FLOAT, Runs.NOT_TENSOR
EXPECTED = {
    "conv": (K, "conv2d+relu"), "bn": (K, "conv2d+relu"), "relu": (K, "conv2d+relu"),
    "pool": (S, "shared"), "size": (NT, "not a float tensor"), "reshape": (S, "shared"),
    "fc1": (K, "linear"), "sigmoid": (T, "sigmoid"), "ln": (FL, "no lowering rule for ln"),
    "mul": (K, "mul"), "fc2": (K, "linear"), "gelu": (T, "gelu"), "fc3": (K, "linear"), "mul_1": (S, "mul"),
    "head": (FL, "QConfig is None for this module/op"),
}


@pytest.fixture(scope="module")
def mixed():
    torch.manual_seed(0)
    model = Mixed().eval()
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    data = [torch.randn(4, 3, 8, 8) for _ in range(4)]
    mapping = get_default_qconfig_mapping().set_module_name("head", None)
    prepared = lucid_fx.prepare(model, mapping, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)
    return model, prepared, lucid_fx.convert(prepared), data


def _viewer_attrs(page: str) -> list:
    data = re.search(r'<script type="application/json" id="lucid-data">(.*?)</script>', page, re.S).group(1)
    return [n["attrs"] for n in json.loads(data)["nodes"].values()]


def test_convert_places_every_node_of_a_model_mixing_every_decision_kind(mixed):
    _, prepared, q, _ = mixed
    placed = q.lucid_fx_convert_report.placements
    assert {name: (p.runs, p.why) for name, p in placed.items()} == EXPECTED
    assert placed["conv"] is placed["bn"] is placed["relu"] and placed["relu"].members == ("conv", "bn", "relu")
    assert placements(q) == placed  # read back from the converted graph's nodes
    assert placements(prepared) == placed  # predicted before convert: the same answer


def test_all_five_readers_agree_node_by_node(mixed, tmp_path):
    model, prepared, q, data = mixed
    truth = q.lucid_fx_convert_report.placements
    # 1. explain, on the prepared model (a prediction), shows it in the runs column.
    rows = lucid_fx.explain(prepared).by_node()
    assert {n: (rows[n]["runs"], rows[n]["runs_why"]) for n in truth} == {n: (p.runs.value, p.why) for n, p in truth.items()}
    assert "table lookup (gelu)" in str(lucid_fx.explain(prepared)).splitlines()[list(rows).index("gelu") + 1]
    # 2. the convert report's summary counts exactly those.
    report = q.lucid_fx_convert_report
    assert set(report.float_ops) == {"ln", "head"} and set(report.lowered) == {"relu", "pool", "reshape", "fc1", "sigmoid", "mul", "fc2", "gelu", "fc3", "mul_1"}
    # matrix FLOPs by hand: conv 2*(4*8*8*8)*(3*3*3), fc1 2*(4*16)*128, fc2 and fc3 2*(4*16)*16, head 2*(4*4)*16
    conv, fc1, fc2, head = 110592, 16384, 2048, 512
    assert (report.total_flops, report.int8_flops) == (conv + fc1 + 2 * fc2 + head, conv + fc1 + 2 * fc2)
    assert str(report).splitlines() == [
        "backend cpu: 10 int8 kernels, 2 ops in float",
        "int8 FLOPs: 99.6% of 132 kFLOP (float: head 0.4%)",
        "  float leaf module: ln (no lowering rule for ln)",
        "  kept float: head (QConfig is None for this module/op, 0.4% of FLOPs)",
    ]
    # 3. compare: every measured op node says where it ran; float ones have the float domain.
    result = lucid_fx.compare(model, q, data)
    measured = {r.node: r for r in result.rows if r.node in truth}
    assert set(measured) == set(truth) - {"conv", "bn", "size"}  # fused members and shapes have no value of their own
    for name, row in measured.items():
        assert row.runs == truth[name].runs.value, name
        assert (row.domain == "float") == (truth[name].runs is Runs.FLOAT), name
    assert result.output_sqnr_db > 30 and result.rows[0].sqnr_db > 30
    # 4. to_networkx, converted and prepared; 5. the viewer's page, which shows those attributes.
    converted, before = lucid_fx.to_networkx(q), lucid_fx.to_networkx(prepared)
    page = lucid_fx.visualize(q, tmp_path / "q.html", layout="layered").read_text()
    checked = set()
    for attrs in list(converted.nodes.values()) + _viewer_attrs(page):
        name = attrs.get("source")
        if name in truth and attrs.get("runs"):
            assert (attrs["runs"], attrs["runs_why"]) == (truth[name].runs.value, truth[name].why), (name, attrs["name"])
            if attrs["domain"] != "boundary":
                assert (attrs["domain"] == "float") == (truth[name].runs in (Runs.FLOAT, Runs.NOT_TENSOR)), (name, attrs["name"])
            checked.add(name)
    assert checked == set(truth) - {"conv", "bn"}  # the group's kernel node carries relu's value
    for name, p in truth.items():
        attrs = before.nodes[name]
        assert (attrs["runs"], attrs["runs_why"]) == (p.runs.value, p.why), name
        assert (attrs["domain"] == "float") == (p.runs in (Runs.FLOAT, Runs.NOT_TENSOR)), name
    assert "runs in float" not in page and "runs in float" not in str(lucid_fx.explain(prepared))


def test_a_model_whose_only_op_stays_float_reports_one_op_in_float():
    # Before: "backend cpu: 0 int8 kernels, 0 ops in float" (only ops meant to be int8 were counted).
    torch.manual_seed(0)
    data = [torch.randn(4, 8) for _ in range(2)]
    q = lucid_fx.quantize(nn.Sequential(nn.Hardshrink()).eval(), (data[0],), data)
    assert str(q.lucid_fx_convert_report).splitlines() == [
        "backend cpu: 0 int8 kernels, 1 op in float",
        "int8 FLOPs: none counted (no linear, conv, matmul or attention with shapes recorded at prepare)",
        "  float leaf module: _0 (no observer rule quantizes this op)",
    ]
    one = lucid_fx.quantize(nn.Sequential(nn.Linear(8, 8)).eval(), (data[0],), data)
    assert str(one.lucid_fx_convert_report).splitlines() == [
        "backend cpu: 1 int8 kernel, 0 ops in float", "int8 FLOPs: 100.0% of 512 FLOP"]  # 2 * (4 * 8) * 8


def test_placements_survive_save_and_load(mixed, tmp_path):
    _, _, q, _ = mixed
    lucid_fx.save(q, tmp_path / "q.pt")
    loaded = lucid_fx.load(tmp_path / "q.pt")
    assert placements(loaded) == q.lucid_fx_convert_report.placements
    assert loaded.lucid_fx_convert_report.placements == q.lucid_fx_convert_report.placements


def test_an_op_kept_float_whose_output_an_int8_op_reads_is_predicted_float():
    # `0` is kept float by the QConfig; the int8 `1` reading it gets its output observed, and `0`
    # itself still runs float, saying why: the prediction says so too.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)).eval()
    data = [torch.randn(4, 8) for _ in range(2)]
    mapping = get_default_qconfig_mapping().set_module_name("0", None)
    prepared = lucid_fx.prepare(model, mapping, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)
    q = lucid_fx.convert(prepared)
    why = "input of quantized _1 (QConfig is None for this module/op)"
    assert placements(q)["_0"] == placements(prepared)["_0"] == Placement(Runs.FLOAT, why, ("_0",))
    assert placements(q)["_1"] == placements(prepared)["_1"] == Placement(Runs.KERNEL, "linear", ("_1",))
    assert lucid_fx.compare(model, q, data).by_node()["_0"].runs == "float"


@pytest.mark.parametrize("name", ["Downsample", "Depthwise", "DenseLayer", "Gated", "Mixed"])
def test_the_prediction_before_convert_is_what_convert_does(name):
    import test_compare

    torch.manual_seed(0)
    model = (globals().get(name) or getattr(test_compare, name))().eval()
    shape = {"Downsample": (2, 4, 8, 8), "Depthwise": (2, 8, 8, 8), "DenseLayer": (2, 4, 8, 8), "Gated": (4, 8)}.get(name, (4, 3, 8, 8))
    data = [torch.randn(*shape) for _ in range(3)]
    options = {"concrete_args": {"gate": True}} if name == "Gated" else {}
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],), **options)
    lucid_fx.calibrate(prepared, data, progress=False)
    predicted = placements(prepared)
    assert predicted and placements(lucid_fx.convert(prepared)) == predicted
