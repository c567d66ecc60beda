"""Standalone batch norms (lucid_fx/rules/lowering_norm.py: lower_batch_norm): DenseNet's
``cat -> batch_norm -> relu -> conv`` runs as one table per channel on the codes, and the program
composes the cat's requantizations and the relu into those tables (rules/program_cpu_elementwise.py),
looked up straight from the cat's parts where the native kernels are loaded."""

import torch
from torch import nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.kernels import native, native_elementwise
from lucid_fx.kernels.library import op_name
from _program import lowered
from models import _init_bn


class DenseLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.grow = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.norm, self.conv = nn.BatchNorm2d(12), nn.Conv2d(12, 6, 1)

    def forward(self, x):
        a = self.stem(x)
        features = torch.cat([a, self.grow(a)], 1)
        return self.conv(torch.relu(self.norm(features)))


def _model():
    torch.manual_seed(0)
    return _init_bn(DenseLayer()).eval()  # statistics that do something


def test_a_batch_norm_after_a_cat_runs_as_a_table_per_channel():
    model, x = _model(), torch.randn(2, 3, 12, 12)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    norm = next(n for n in prepared.graph.nodes if n.target == "norm")
    assert norm.meta[_meta.DECISION].kind.value == "statistics"
    lucid_fx.calibrate(prepared, [x, torch.randn_like(x), 2 * torch.randn_like(x)], progress=False)
    q = lucid_fx.convert(prepared)
    assert q.lucid_fx_convert_report.float_ops == {}
    assert [op_name(n) for n in q.graph.nodes].count("channel_lut") == 1
    y, expected = q(x), model(x)
    sqnr = 10 * torch.log10(expected.pow(2).mean() / (y - expected).pow(2).mean())
    assert sqnr > 30, f"{sqnr:.1f} dB"


def test_the_program_composes_the_cat_and_the_relu_into_the_tables_with_the_same_values():
    model, x = _model(), torch.randn(2, 3, 12, 12)
    q = lucid_fx.quantize(model, (x,), [x, torch.randn_like(x), 2 * torch.randn_like(x)])
    portable, program, targets = lowered(q, x)
    assert torch.equal(program(x), portable)
    calls = [getattr(t, "__name__", str(t)) for t in targets]
    assert "lut" not in calls, calls  # the relu and the cat's tables: composed
    if native.available():  # one pass over the cat's parts, without the cat (LUCID_FX_NATIVE=0 reruns the rest)
        assert calls.count("channel_lut_cat") == 1 and "cat" not in calls and "channel_lut" not in calls, calls
        assert native_elementwise.channel_lut_cat in targets
    else:
        assert calls.count("channel_lut") == 1 and calls.count("cat") == 1, calls
