"""rewrite_weight_products: ``x @ W`` with ``W`` a weight of the model's own becomes ``F.linear(x, W.T)``: the
weight quantized once per output channel and the product the int8 linear kernel, where it was a product of two
activations whose weight side was rounded on one scale and quantized again on every call."""

import operator

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx


class Products(nn.Module):
    """The spellings of a product by a weight: a parameter, its transpose, a tied embedding's, a normalized one."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Linear(16, 32)
        self.w = nn.Parameter(torch.randn(32, 24) / 6)  # (in, out): x @ w
        self.emb = nn.Embedding(10, 24)  # tied: h @ emb.weight.T
        self.proto = nn.Parameter(torch.randn(12, 24))  # cosine classifier: h @ normalize(proto).t()

    def forward(self, x):
        h = torch.relu(self.enc(x) @ self.w)
        return torch.cat([h @ self.emb.weight.T, torch.mm(h, F.normalize(self.proto, dim=-1).t()), x.matmul(self.w[:16])], -1)


def _batches(n=6):
    return [torch.randn(8, 16, generator=torch.Generator().manual_seed(s)) for s in range(n)]


def test_a_product_by_a_weight_of_the_model_s_own_runs_as_an_int8_linear(sqnr_db):
    torch.manual_seed(0)
    model = Products().eval()
    prepared = lucid_fx.prepare(model, example_inputs=(_batches(1)[0],))
    calls = [n.target for n in prepared.graph.nodes if n.op == "call_function"]
    assert calls.count(F.linear) == 4 and not {operator.matmul, torch.mm} & set(calls)
    x = _batches(1)[0]
    with torch.no_grad():
        assert torch.allclose(prepared(x), model(x), atol=1e-5)  # the same values
    lucid_fx.calibrate(prepared, _batches(), progress=False)
    qmodel = lucid_fx.convert(prepared)
    lowered = qmodel.lucid_fx_convert_report.lowered
    assert lowered["relu"] == "linear+relu"  # the product keeps its name, fused with its relu as any linear
    assert [lowered[name] for name in ("matmul_1", "mm", "matmul_2")] == ["linear"] * 3, lowered
    targets = [n.target for n in qmodel.graph.nodes]
    assert targets.count(torch.ops.lucid_fx.linear) == 5 and torch.ops.lucid_fx.matmul not in targets
    assert F.normalize not in targets  # computed once, at convert
    reference = lucid_fx.convert(prepared, reference=True)
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 33  # 34.4 dB before, with the tied embedding's product declined
        assert sqnr_db(reference(x), qmodel(x)) > 40  # the reference quantizes the computed weights the same way


class NotWeights(nn.Module):
    """Products that stay products: of two activations, a weight on the left, a 3-D parameter, a weight with
    noise added on every call (lucid_fx/computed_weights.py: a buffer the model writes is no weight either)."""

    def __init__(self):
        super().__init__()
        self.left, self.stack = nn.Parameter(torch.randn(8, 8)), nn.Parameter(torch.randn(2, 8, 8))

    def forward(self, x):
        a = x @ x.transpose(-2, -1)
        b = self.left @ x
        c = x @ self.stack
        e = x @ (self.left + torch.randn_like(self.left))
        return a.sum() + b.sum() + c.sum() + e.sum()


def test_products_of_activations_and_random_weights_stay_products():
    prepared = lucid_fx.prepare(NotWeights().eval(), example_inputs=(torch.randn(2, 8, 8),))
    calls = [n.target for n in prepared.graph.nodes if n.op == "call_function"]
    assert calls.count(operator.matmul) == 4 and F.linear not in calls
