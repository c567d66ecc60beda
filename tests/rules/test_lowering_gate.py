"""rules/lowering_gate.py: a gated product of two linears' results, rounded once."""

import pytest
import torch
from torch import nn

import lucid_fx
from _program import graph_until
from lucid_fx import _meta
from lucid_fx.kernels.target import resolve_target
from lucid_fx.passes.lower_to_int8 import lower_to_int8, lowering_table
from lucid_fx.passes.predict_placement import predict_placement
from lucid_fx.rules import lowering_gate
from lucid_fx.rules.lowering_gate import GATE_WHY, PRODUCT_OF, PRODUCT_WHY


class Gated(nn.Module):
    """out(f(value(x)) * g(gate(x))); ``keep`` also returns the first factor (then the product reads
    codes that another reader needs too)."""

    def __init__(self, f=torch.tanh, g=torch.sigmoid, keep=False, width=64, gain=1.0):
        super().__init__()
        self.value, self.gate, self.out = nn.Linear(32, width), nn.Linear(32, width), nn.Linear(width, 8)
        self.f, self.g, self.keep = f, g, keep
        with torch.no_grad():
            self.value.weight.mul_(gain), self.gate.weight.mul_(gain)

    def forward(self, x):
        a = self.f(self.value(x))
        y = self.out(a * self.g(self.gate(x)))
        return (y, a) if self.keep else y


def _converted(model, **kwargs):
    torch.manual_seed(0)
    batches = [torch.randn(16, 32) * 2 for _ in range(4)]
    prepared = lucid_fx.prepare(model.eval(), example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    return prepared, lucid_fx.convert(prepared, **kwargs)


def _targets(gm):
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


def _rounded(reference):
    """The values a reference model rounds."""
    return sorted(n.meta[_meta.SOURCE] for n in reference.graph.nodes if str(n.target) == "lucid_fx.quantize_per_tensor")


def _sqnr(ref, out):
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


def test_the_product_of_a_tanh_and_a_sigmoid_is_rounded_once():
    torch.manual_seed(0)
    model = Gated()
    prepared, qmodel = _converted(model)
    linears = [n for n in qmodel.graph.nodes if str(n.target) == "lucid_fx.linear"]
    assert "lucid_fx.mul" not in _targets(qmodel) and "<built-in method addcmul of type object" in str(_targets(qmodel))
    # both factors come out of their linears in float, the tanh and the sigmoid as oneDNN's tanh post-op
    # (the sigmoid's as tanh(y / 2) on halved weight scales), read by one addcmul: t * (1 + t2)
    value, gate = linears[:2]
    assert [(n.args[8], n.args[9]) for n in (value, gate)] == [("tanh", torch.float32)] * 2
    (addcmul,) = [n for n in qmodel.graph.nodes if "addcmul" in str(n.target)]
    assert addcmul.args == (value, value, gate)
    (quantize,) = addcmul.users
    (mul,) = [n for n in prepared.graph.nodes if n.name == "mul"]
    scale, zp = prepared.lucid_fx_observers[mul.meta[_meta.OBSERVER]].calculate_qparams()
    assert str(quantize.target) == "lucid_fx.quantize_per_tensor" and quantize.args[1:3] == (2 * float(scale), int(zp))
    report = qmodel.lucid_fx_convert_report
    assert report.lowered["tanh"] == report.lowered["sigmoid"] == PRODUCT_WHY.format(mul="mul")
    assert report.lowered["mul"] == PRODUCT_OF  # not lucid_fx.mul
    assert report.lowered["value"] == GATE_WHY.format(act="tanh") and report.lowered["gate"] == GATE_WHY.format(act="sigmoid")
    # the product's codes: tanh(y1) * sigmoid(y2) of the linears' float results, one rounding
    x = torch.randn(16, 32) * 2
    until = torch.fx.GraphModule(qmodel, graph_until(qmodel.graph, quantize))
    with torch.no_grad():
        codes = until(x).to(torch.int32)
        xq = torch.ops.lucid_fx.quantize_per_tensor(x, *value.args[1:3], 0, 255, torch.uint8)
        y1, y2 = (_float_result(qmodel, lin, xq) for lin in (value, gate))
        exact = torch.round(torch.tanh(y1) * (1 + torch.tanh(y2)) / quantize.args[1]) + zp
    assert (codes - exact).abs().max() <= 1 and (codes == exact).float().mean() > 0.99
    assert torch.allclose(torch.tanh(y2) * 0.5 + 0.5, torch.sigmoid(model.gate(x)), atol=0.03)  # the halved weights (x rounded: not closer)


def _product_error(qmodel, product, x, exact, step):
    """The RMS error, in steps of the product's grid, of the codes ``product`` holds against ``exact``."""
    with torch.no_grad():
        codes = torch.fx.GraphModule(qmodel, graph_until(qmodel.graph, product))(x).float()
    return float(((codes - product.meta[_meta.QPARAMS][1]) * product.meta[_meta.QPARAMS][0] - exact).div(step).pow(2).mean().sqrt())


def test_the_fused_product_is_more_accurate_and_the_reference_rounds_alike(monkeypatch):
    torch.manual_seed(0)
    model = Gated(width=256, gain=2.0)
    prepared, qmodel = _converted(model)
    reference = lucid_fx.convert(prepared, reference=True)
    # reference mode rounds what the kernels round: x and the product (out gives its float result)
    assert _rounded(reference) == ["mul", "x"]
    x = torch.randn(64, 32) * 2
    fused_db = lucid_fx.compare(model, qmodel, [x]).by_node()["mul"].sqnr_db
    assert lucid_fx.compare(model, reference, [x]).by_node()["mul"].sqnr_db == pytest.approx(fused_db, abs=0.3)
    # against the product of the linears' float results (what int8 x gives): one rounding against three
    value, gate = [n for n in qmodel.graph.nodes if str(n.target) == "lucid_fx.linear"][:2]
    (product,) = [n for n in qmodel.graph.nodes if "addcmul" in str(n.target)][0].users
    with torch.no_grad():
        xq = torch.ops.lucid_fx.quantize_per_tensor(x, *value.args[1:3], 0, 255, torch.uint8)
        y1, y2 = (_float_result(qmodel, lin, xq) for lin in (value, gate))
    exact, step = torch.tanh(y1) * (1 + torch.tanh(y2)) / 2, product.meta[_meta.QPARAMS][0]
    fused = _product_error(qmodel, product, x, exact, step)
    monkeypatch.setattr(lowering_gate, "product_factor", lambda *args: False)
    unfused_model = lucid_fx.convert(prepared)
    (mul,) = [n for n in unfused_model.graph.nodes if str(n.target) == "lucid_fx.mul"]
    assert _rounded(lucid_fx.convert(prepared, reference=True)) == ["mul", "sigmoid", "tanh", "x"]
    unfused = _product_error(unfused_model, mul, x, exact, step)
    print(f"product error, RMS steps: fused {fused:.3f}, unfused {unfused:.3f}")
    assert fused < 0.3 < 1.2 * fused < unfused  # a rounding alone is 1/sqrt(12) = 0.289 steps


@pytest.mark.parametrize("case", ["factor read elsewhere", "silu and a linear", "two plain linears"])
def test_a_product_that_saves_no_gate_rounding_stays_the_int8_kernel(case):
    model = {"factor read elsewhere": Gated(keep=True), "silu and a linear": Gated(nn.functional.silu, lambda y: y),
             "two plain linears": Gated(lambda y: y, lambda y: y)}[case]
    _, qmodel = _converted(model)
    assert "lucid_fx.mul" in _targets(qmodel) and "addcmul" not in str(_targets(qmodel))
    assert not any(why.startswith("computed in float inside") for why in qmodel.lucid_fx_convert_report.lowered.values())


def test_a_tanh_times_a_plain_linear_is_one_mul_of_float_results():
    torch.manual_seed(0)
    model = Gated(torch.tanh, lambda y: y)
    prepared, qmodel = _converted(model)
    (mul,) = [n for n in qmodel.graph.nodes if n.op == "call_function" and n.target is torch.mul]
    assert [(a.args[8], a.args[9]) for a in mul.args] == [("tanh", torch.float32), ("none", torch.float32)]
    x = torch.randn(16, 32) * 2
    with torch.no_grad():
        assert _sqnr(model(x), qmodel(x)) > 30


def test_prediction_names_the_factors_as_convert_does():
    prepared, _ = _converted(Gated())
    registry = lucid_fx.current_registry()
    predicted = predict_placement(prepared, lowering_table(registry.lowerings, "cpu"))
    assert predicted["tanh"].why == predicted["sigmoid"].why == PRODUCT_WHY.format(mul="mul")
    assert predicted["mul"].why == PRODUCT_OF
    _, report = lower_to_int8(prepared, registry.lowerings, resolve_target("cpu"))
    assert report.placements == predicted


def test_a_saved_gated_model_loads_and_computes_the_same(tmp_path):
    _, qmodel = _converted(Gated())
    lucid_fx.save(qmodel, tmp_path / "gated.lfx")
    loaded = lucid_fx.load(tmp_path / "gated.lfx")
    x = torch.randn(16, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))
    assert "addcmul" in str(_targets(loaded))


def _float_result(qmodel, linear, xq):
    """The float32 result, no post-op, of the lucid_fx.linear ``linear`` of ``qmodel`` on the codes ``xq``."""
    args = [getattr(qmodel, a.target) if isinstance(a, torch.fx.Node) else a for a in linear.args[1:6]]
    return torch.ops.lucid_fx.linear(xq, *args, 1.0, 0, "none", torch.float32)


class Squared(nn.Module):
    def __init__(self):
        super().__init__()
        self.value, self.out = nn.Linear(32, 64), nn.Linear(64, 8)

    def forward(self, x):
        t = torch.tanh(self.value(x))
        return self.out(t * t)


def test_a_gate_times_itself_reads_one_float_linear():
    torch.manual_seed(0)
    model = Squared()
    _, qmodel = _converted(model)
    floats = [n for n in qmodel.graph.nodes if str(n.target) == "lucid_fx.linear" and n.args[9] is torch.float32
              and n.args[8] == "tanh"]  # (out's float result aside)
    (mul,) = [n for n in qmodel.graph.nodes if n.op == "call_function" and n.target is torch.mul]
    assert len(floats) == 1 and mul.args == (floats[0], floats[0])
    x = torch.randn(16, 32) * 2
    with torch.no_grad():
        assert _sqnr(model(x), qmodel(x)) > 30
