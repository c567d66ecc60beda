"""compare: per-node error of a quantized model against its float model."""

import math

import pytest
import torch
from torch import nn

import lucid_fx
from test_graph_model import Gate


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    model = Gate().eval()
    data = [torch.randn(8, 16) for _ in range(4)]
    prepared = lucid_fx.prepare(model, example_inputs=(data[0],))
    lucid_fx.calibrate(prepared, data, progress=False)
    return model, prepared, lucid_fx.convert(prepared), data


def _manual_sqnr(ref, test):
    return 10 * math.log10(float((ref * ref).sum()) / float(((ref - test) ** 2).sum()))


def test_rows_are_worst_first_and_cover_every_quantized_value(models):
    model, _, q, data = models
    result = lucid_fx.compare(model, q, data)
    names = [r.node for r in result.rows]
    assert set(names) == {"x", "l1", "tanh", "add", "truediv", "ln", "mul", "l2", "softmax"}
    sqnrs = [r.sqnr_db for r in result.rows]
    assert sqnrs == sorted(sqnrs) and result.batches == 4
    rows = result.by_node()
    assert rows["tanh"].domain == "fixed" and rows["l1"].domain == "int8" and rows["tanh"].scale == 2 / 256
    assert rows["ln"].op == "layer_norm" and rows["l2"].op == "linear"
    # Fixed-grid values are off by at most a few steps; the output within 1 dB of the last node.
    assert all(r.max_steps is not None and r.max_steps < 4 for r in result.rows)
    assert result.output_sqnr_db == pytest.approx(rows["softmax"].sqnr_db, abs=1.0)


def test_input_row_equals_a_hand_computed_quantization_error(models):
    model, prepared, q, data = models
    observer = prepared.lucid_fx_observers[prepared.graph.find_nodes(op="placeholder")[0].meta["lucid_fx.observer"]]
    scale, zp = (float(v) for v in observer.calculate_qparams())
    x = torch.cat(data)
    fq = (torch.clamp(torch.round(x / scale) + zp, 0, 255) - zp) * scale
    row = lucid_fx.compare(model, q, data).by_node()["x"]
    assert row.sqnr_db == pytest.approx(_manual_sqnr(x, fq), abs=1e-3)
    assert row.max_abs == pytest.approx(float((x - fq).abs().max()), rel=1e-5)
    assert row.numel == x.numel()


def test_output_sqnr_is_the_model_output_error(models):
    model, _, q, data = models
    result = lucid_fx.compare(model, q, data[:2])
    with torch.no_grad():
        ref = torch.cat([model(d) for d in data[:2]])
        test = torch.cat([q(d) for d in data[:2]])
    assert result.output_sqnr_db == pytest.approx(_manual_sqnr(ref, test), abs=1e-3)
    assert result.batches == 2


def test_reference_model_compares_like_the_int8_one(models):
    model, prepared, q, data = models
    ref = lucid_fx.convert(prepared, reference=True)
    real, simulated = lucid_fx.compare(model, q, data).by_node(), lucid_fx.compare(model, ref, data).by_node()
    assert set(real) == set(simulated)
    # LayerNorm runs in float on the float x in both: the reference does not fake-quantize its input.
    assert simulated["ln"].sqnr_db == real["ln"].sqnr_db and simulated["ln"].op == real["ln"].op == "layer_norm"
    for name in real:  # the kernels compute what the simulation does, up to rounding
        assert simulated[name].sqnr_db == pytest.approx(real[name].sqnr_db, abs=1.5), name


def test_table_text(models):
    model, _, q, data = models
    text = str(lucid_fx.compare(model, q, data[0]))
    lines = text.splitlines()
    assert lines[0].split() == ["node", "op", "domain", "SQNR", "dB", "max", "|err|", "steps"]
    assert len(lines) == 1 + 9 + 1 and lines[-1].startswith("model output: ") and "over 1 batch(es)" in lines[-1]


def test_a_float_model_compared_with_itself_is_exact():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval()
    traced = torch.fx.symbolic_trace(model)
    result = lucid_fx.compare(model, traced, torch.randn(3, 4))
    # A plain traced graph carries no convert metadata: nothing to match, and an exact output.
    assert result.output_sqnr_db == math.inf and result.batches == 1


def test_bad_arguments():
    model = nn.Linear(2, 2)
    with pytest.raises(TypeError, match="quantized_model must be an nn.Module, got str"):
        lucid_fx.compare(model, "q.pt", torch.zeros(1, 2))
    with pytest.raises(ValueError, match="holds no torch.fx GraphModule"):
        lucid_fx.compare(model, nn.Linear(2, 2), torch.zeros(1, 2))
    with pytest.raises(ValueError, match="at least one batch"):
        lucid_fx.compare(model, torch.fx.symbolic_trace(model), [])
