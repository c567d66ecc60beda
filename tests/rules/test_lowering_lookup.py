"""embedding: the table quantized once onto the output's grid, the lookup reading codes; the
result equals quantizing the float lookup (one grid, no arithmetic in between)."""

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx


class Tokens(nn.Module):
    def __init__(self, max_norm=None):
        super().__init__()
        self.embed = nn.Embedding(100, 32, padding_idx=0, max_norm=max_norm)
        self.table = nn.Parameter(torch.randn(50, 32))
        self.fc = nn.Linear(32, 8)

    def forward(self, ids):
        return self.fc(self.embed(ids) + F.embedding(ids % 50, self.table))


def _convert(model):
    torch.manual_seed(0)
    prepared = lucid_fx.prepare(model.eval(), example_inputs=(torch.randint(0, 100, (4, 12)),))
    for seed in range(4):
        prepared(torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(seed)))
    return prepared, lucid_fx.convert(prepared)


def test_embedding_module_and_function_look_up_codes():
    torch.manual_seed(0)
    model = Tokens()
    prepared, converted = _convert(model)
    report = converted.lucid_fx_convert_report
    assert report.float_ops == {} and report.lowered["embed"] == report.lowered["embedding"] == "embedding"
    lookups = [n for n in converted.graph.nodes if n.target is F.embedding]
    assert len(lookups) == 2 and all(getattr(converted, n.args[1].target).dtype == torch.uint8 for n in lookups)
    ids = torch.randint(0, 100, (4, 12), generator=torch.Generator().manual_seed(9))
    ref, out = model(ids), converted(ids)
    assert 10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()) > 30
    # the lookup's codes are exactly the float lookup quantized on the observer's grid
    scale, zp = prepared.lucid_fx_observers["embed"].calculate_qparams()
    codes = torch.ops.lucid_fx.quantize_per_tensor(model.embed(ids), float(scale), int(zp), 0, 255, torch.uint8)
    assert torch.equal(F.embedding(ids, getattr(converted, lookups[0].args[1].target), 0), codes)


def test_max_norm_changes_the_table_so_the_lookup_stays_float():
    _, converted = _convert(Tokens(max_norm=1.0))
    assert "embed" in converted.lucid_fx_convert_report.float_ops
