"""lucid_fx/op_overloads.py: spellings whose op depends on their arguments (torch.max of two tensors, of
everything, over a dim; ``x.T``, ``x.mT``, ``pair.values``) become the op they are, where they stayed float
("no lowering rule for max", a product of ``k.T`` declined)."""

import torch
from torch import nn

import lucid_fx
from lucid_fx import _meta


class Spellings(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):  # x: (6, 8)
        q, k = self.q(x), self.k(x)
        scores = (q @ k.T + q @ k.t() + q @ torch.t(k) + q @ k.mT).softmax(-1)  # (6, 6)
        pooled = scores.max(dim=0).values + torch.max(scores, 0)[0] + torch.min(scores, 0).values  # (6,)
        return self.head(torch.max(q, k) + torch.minimum(q, k) + pooled.unsqueeze(1) * torch.max(scores))


def test_each_spelling_becomes_the_op_it_is():
    torch.manual_seed(0)
    prepared = lucid_fx.prepare(Spellings().eval(), example_inputs=(torch.randn(6, 8),))
    ops = {n.name: n.meta[_meta.OP].op for n in prepared.graph.nodes if _meta.OP in n.meta}
    assert [ops[n] for n in ("getattr_1", "t", "t_1", "getattr_2")] == ["transpose"] * 4  # k.T, k.t(), torch.t(k), k.mT
    assert [ops[n] for n in ("max_1", "getattr_3", "max_2", "getitem", "min_1", "getattr_4")] == \
        ["max", "getitem", "max", "getitem", "min", "getitem"]  # over a dim: (values, indices), its values an item
    assert [ops[n] for n in ("max_3", "minimum", "max_4")] == ["maximum", "minimum", "amax"]  # of two tensors, of everything


def test_they_run_on_codes():
    torch.manual_seed(0)
    model = Spellings().eval()
    batches = [torch.randn(6, 8, generator=torch.Generator().manual_seed(s)) for s in range(6)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    report = lucid_fx.convert(prepared).lucid_fx_convert_report
    runs = {name: p.runs.value for name, p in report.placements.items()}
    assert {runs[n] for n in ("getattr_1", "t", "t_1", "getattr_2", "getattr_3", "getitem", "getattr_4", "max_4")} == {"shared codes"}
    assert [runs[n] for n in ("matmul", "max_3", "minimum")] == ["int8 kernel"] * 3
    assert not [p for p in report.placements.values() if p.why.startswith("no lowering rule")], str(report)
