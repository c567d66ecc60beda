"""lucid_fx/rules/lowering_attention.py: a softmax read only by a matmul's left operand is fused into
``lucid_fx.softmax_matmul`` (each row's probabilities on a grid of their own), what convert reports
about it, where it declines, and what reference mode puts in its place."""

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.kernels.library import op_name
from lucid_fx.rules import lowering_attention


class Attention(nn.Module):
    """Two heads over 96 keys: an untrained model's probabilities are spread over many keys."""

    def __init__(self, d: int = 32, dim: int = -1, second_reader: bool = False):
        super().__init__()
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.dim, self.second_reader = dim, second_reader

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).reshape(b, s, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        p = F.softmax(torch.matmul(q, k.transpose(-2, -1)) * (d // 2) ** -0.5, dim=self.dim)
        y = torch.matmul(p, v)
        if self.second_reader:
            y = y + torch.matmul(p, v * 2)
        return self.proj(y.transpose(1, 2).reshape(b, s, d))


def _data(n: int = 6):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(2, 96, 32, generator=g) for _ in range(n)]


def _convert(model, reference: bool = False):
    data = _data()
    prepared = lucid_fx.prepare(model.eval(), example_inputs=(data[0],))
    for x in data[:4]:
        prepared(x)
    return lucid_fx.convert(prepared, reference=reference), data[5]


def _ops(gm):
    return [op_name(n) for n in gm.graph.nodes if op_name(n)]


def test_the_softmax_before_p_at_v_is_fused_and_its_probabilities_keep_their_precision(sqnr_db, monkeypatch):
    torch.manual_seed(0)
    model = Attention()
    qmodel, x = _convert(model)
    assert _ops(qmodel).count("softmax_matmul") == 1 and "softmax" not in _ops(qmodel)
    assert _ops(qmodel).count("matmul") == 1  # q @ k^T
    report = qmodel.lucid_fx_convert_report
    assert report.lowered["softmax"] == lowering_attention.FUSED_SOFTMAX.format(matmul="matmul_1")
    with torch.no_grad():
        fused_db = sqnr_db(model(x), qmodel(x))
    monkeypatch.setattr(lowering_attention, "softmax_read_only_by", lambda *args: False)
    unfused, _ = _convert(model)
    assert _ops(unfused).count("softmax") == 1 and "softmax_matmul" not in _ops(unfused)
    with torch.no_grad():
        unfused_db = sqnr_db(model(x), unfused(x))
    print(f"fused {fused_db:.1f} dB, the fixed grid {unfused_db:.1f} dB")
    assert fused_db > 35 and fused_db > unfused_db + 8


@pytest.mark.parametrize("variant", [{"dim": -2}, {"second_reader": True}], ids=["softmax along the queries", "two readers"])
def test_a_softmax_that_is_not_only_p_at_v_s_left_operand_stays_a_softmax(variant):
    torch.manual_seed(0)
    qmodel, _ = _convert(Attention(**variant))
    assert "softmax_matmul" not in _ops(qmodel) and _ops(qmodel).count("softmax") == 1


def test_reference_mode_rounds_the_probabilities_as_the_fused_kernel_does(sqnr_db):
    torch.manual_seed(0)
    model = Attention()
    reference, x = _convert(model, reference=True)
    qmodel, _ = _convert(model)
    assert _ops(reference).count("probabilities_qdq") == 1
    with torch.no_grad():
        assert sqnr_db(reference(x), qmodel(x)) > 40  # the kernels compute what the simulation says


def test_a_converted_model_with_the_fused_op_saves_and_loads():
    torch.manual_seed(0)
    qmodel, x = _convert(Attention())
    buffer = io.BytesIO()
    lucid_fx.save(qmodel, buffer)
    buffer.seek(0)
    loaded = lucid_fx.load(buffer)
    assert "softmax_matmul" in _ops(loaded)
    with torch.no_grad():
        assert torch.equal(loaded(x), qmodel(x))
