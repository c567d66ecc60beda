"""narrow_fixed_grids: a fixed grid that its input cannot fill shrinks to what the input's grid reaches.

Gemma 2's soft-capping, ``tanh(x / c) * c``, measured 7.4 dB output SQNR before this pass (every
capped value in one or two codes of the proven [-1, 1] and [-c, c] grids) and 24.7 dB after it.
"""

import math

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.passes import narrow_fixed_grids as pass_module


class SoftCap(nn.Module):
    """Scores soft-capped as Gemma 2 caps its attention scores."""

    def __init__(self, cap: float = 50.0):
        super().__init__()
        self.fc = nn.Linear(16, 8)
        self.cap = cap

    def forward(self, x):
        return torch.tanh(self.fc(x) / self.cap) * self.cap


class Saturating(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return torch.tanh(self.fc(x) * 8)


def _data(seed, n=8):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(32, 16, generator=g) for _ in range(n)]


def _quantize(model, **kwargs):
    return lucid_fx.quantize(model, (_data(0, 1)[0],), _data(1), progress=False, **kwargs)


def _narrowed(qmodel):
    """{op of the prepared node: its decision's interval} for every narrowed group end."""
    return {n.meta[_meta.SOURCE]: n.meta[_meta.DECISION].interval for n in qmodel.graph.nodes
            if _meta.DECISION in n.meta and "grid narrowed" in n.meta[_meta.DECISION].reason}


def test_soft_capped_scores_get_the_grid_their_input_reaches(sqnr_db):
    torch.manual_seed(0)
    model, x = SoftCap().eval(), _data(9, 1)[0]
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    lucid_fx.calibrate(prepared, _data(1), progress=False)
    qmodel = lucid_fx.convert(prepared)
    narrowed = _narrowed(qmodel)
    assert set(narrowed) == {"mul"}, narrowed  # tanh is inside mul's table (rules/one_source.py): no lookup of its own
    scale, zero_point = (float(v) for v in prepared.lucid_fx_observers["truediv"].calculate_qparams())
    lo, hi = scale * (0 - zero_point), scale * (255 - zero_point)  # fc(x) / 50 on its calibrated grid
    # tanh's grid narrowed to the image of that grid, and mul's to 50 times tanh's (to a step of 256)
    image = (50 * math.tanh(lo), 50 * math.tanh(hi))
    assert narrowed["mul"] == pytest.approx(image, abs=(image[1] - image[0]) / 100)
    assert hi - lo < 0.25  # where the proofs gave [-1, 1] and [-50, 50]
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) > 35


def test_without_narrowing_the_fixed_grids_lose_the_values(monkeypatch, sqnr_db):
    torch.manual_seed(0)
    model, x = SoftCap().eval(), _data(9, 1)[0]
    monkeypatch.setattr(pass_module, "NARROWING", 0.0)  # no grid is ever narrow enough
    qmodel = _quantize(model)
    assert _narrowed(qmodel) == {}
    with torch.no_grad():
        assert sqnr_db(model(x), qmodel(x)) < 15


def test_a_tanh_that_fills_its_grid_keeps_the_fixed_one():
    torch.manual_seed(0)
    qmodel = _quantize(Saturating().eval())
    assert _narrowed(qmodel) == {}
    tanh = next(n for n in qmodel.graph.nodes if n.meta.get(_meta.SOURCE) == "tanh" and _meta.QPARAMS in n.meta)
    assert tanh.meta[_meta.QPARAMS][:2] == (2.0 / 256, 128)  # the fixed [-1, 1] grid


def test_the_reference_model_simulates_the_same_grids(sqnr_db):
    torch.manual_seed(0)
    model, x = SoftCap().eval(), _data(9, 1)[0]
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    lucid_fx.calibrate(prepared, _data(1), progress=False)
    qmodel, reference = lucid_fx.convert(prepared), lucid_fx.convert(prepared, reference=True)
    with torch.no_grad():
        assert sqnr_db(model(x), reference(x)) > 35
        assert sqnr_db(reference(x), qmodel(x)) > 40
    assert prepared.lucid_fx_observers["tanh"].scale == pytest.approx(2.0 / 256)  # the prepared model keeps its grid
