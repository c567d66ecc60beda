"""decompose_attention (passes/decompose_attention.py): F.scaled_dot_product_attention written out as
eager attention computes it, so its matmuls and softmax run in int8; the written-out graph computes
what the call did (float mask, bool mask, causal, default scale, grouped-query), keeps its name, and
a call with dropout or unknown shapes is left alone."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lucid_fx
from lucid_fx.passes.decompose_attention import decompose_attention
from lucid_fx.passes.propagate_shapes import propagate_shapes


class Attention(nn.Module):
    def __init__(self, **options):
        super().__init__()
        self.options = options

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, **self.options) + 1


class MaskedAttention(Attention):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, mask, **self.options) + 1


def _written(module, *inputs):
    gm = fx.symbolic_trace(module)
    propagate_shapes(gm, inputs)
    return decompose_attention(gm, inputs)


def _calls(gm):
    return [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes if n.op in ("call_function", "call_method")]


CASES = {
    "float mask, given scale": (dict(scale=0.3), (2, 4, 5, 8), (2, 4, 7, 8), lambda: torch.randn(2, 1, 5, 7)),
    "bool mask, default scale": (dict(), (2, 4, 5, 8), (2, 4, 7, 8), lambda: torch.rand(2, 1, 5, 7) > 0.3),
    "causal": (dict(is_causal=True), (2, 4, 6, 8), (2, 4, 6, 8), lambda: None),
    "grouped-query": (dict(enable_gqa=True), (2, 4, 5, 8), (2, 2, 7, 8), lambda: None),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_written_out_attention_computes_what_the_call_did(case):
    options, q_shape, kv_shape, make_mask = CASES[case]
    torch.manual_seed(0)
    q, k, v, mask = torch.randn(q_shape), torch.randn(kv_shape), torch.randn(kv_shape), make_mask()
    module = Attention(**options) if mask is None else MaskedAttention(**options)
    inputs = (q, k, v) if mask is None else (q, k, v, mask)
    gm = _written(module, *inputs)
    calls = _calls(gm)
    assert "scaled_dot_product_attention" not in calls and calls.count("matmul") == 2 and "softmax" in calls, gm.code
    torch.testing.assert_close(gm(*inputs), module(*inputs), rtol=1e-5, atol=1e-5)
    assert "scaled_dot_product_attention" in [n.name for n in gm.graph.nodes], "the output keeps the call's name"


def test_dropout_or_unknown_shapes_leave_the_call_as_it_is():
    q = torch.randn(1, 2, 3, 4)
    gm = _written(Attention(dropout_p=0.1), q, q, q)
    assert "scaled_dot_product_attention" in _calls(gm)
    unshaped = decompose_attention(fx.symbolic_trace(Attention()))
    assert "scaled_dot_product_attention" in _calls(unshaped)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, 32))


def test_an_sdpa_block_converts_with_its_attention_in_int8():
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(2, 6, 32)
    q = lucid_fx.quantize(model, (x,), [torch.randn(2, 6, 32) for _ in range(4)])
    report = q.lucid_fx_convert_report
    assert report.int8_flop_share == 1.0 and not any("scaled_dot" in name for name in report.float_ops), str(report)
    expected = model(x)
    sqnr = 10 * torch.log10(expected.pow(2).mean() / (q(x) - expected).pow(2).mean())
    assert sqnr > 25, f"{sqnr:.1f} dB"
