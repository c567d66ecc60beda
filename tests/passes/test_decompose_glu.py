"""decompose_glu: a gated linear unit becomes chunk -> sigmoid -> product, its halves views of the input's codes
and its product lucid_fx's int8 mul, where the one call ran in float."""

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx


class Gated(nn.Module):
    """A conformer's convolution module's gate (F.glu over channels) and nn.GLU over the last dim."""

    def __init__(self):
        super().__init__()
        self.pw, self.glu, self.fc = nn.Conv1d(8, 16, 1), nn.GLU(), nn.Linear(8, 6)

    def forward(self, x):
        h = F.glu(self.pw(x), dim=1)  # (2, 8, 20)
        return self.glu(self.fc(h.transpose(1, 2)))  # (2, 20, 3)


def _batches(n=6):
    return [torch.randn(2, 8, 20, generator=torch.Generator().manual_seed(s)) for s in range(n)]


def test_glu_runs_as_views_a_table_and_an_int8_product(sqnr_db):
    torch.manual_seed(0)
    model = Gated().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(_batches(1)[0],))
    calls = [n.target for n in prepared.graph.nodes if n.op == "call_function"]
    assert F.glu not in calls and calls.count(torch.chunk) == 2 and calls.count(torch.sigmoid) == 2
    x = _batches(1)[0]
    with torch.no_grad():
        assert torch.equal(prepared(x), model(x))  # written out, the same values
    lucid_fx.calibrate(prepared, _batches(), progress=False)
    qmodel = lucid_fx.convert(prepared)
    placed = qmodel.lucid_fx_convert_report.placements
    assert placed["glu"].why == "mul" and torch.ops.lucid_fx.mul in {n.target for n in qmodel.graph.nodes}  # the call's name
    # the last one feeds only the output: its product is taken in float (fold_dequantize), nothing else is
    assert qmodel.lucid_fx_convert_report.float_ops == {"glu_1": "mul runs in float: nothing reads its codes, so int8 would only add a rounding"}
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 35
