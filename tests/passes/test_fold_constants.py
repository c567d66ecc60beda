"""fold_constants (passes/fold_constants.py): what a model computes only from its buffers and constants
is computed once, at prepare, and read as a buffer; parameters, shapes and what is written in place stay."""

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.passes.fold_constants import FOLDED_REASON, MAX_BYTES, PREFIX


def _calls(gm):
    return [n.target if isinstance(n.target, str) else n.target.__name__ for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")]


def _quantized(model, x):
    # torch.fx evaluates a buffer's arithmetic while it traces; torch.export keeps it in the graph.
    prepared = lucid_fx.prepare(torch.export.export(model.eval(), (x,), strict=False), example_inputs=(x,))
    lucid_fx.calibrate(prepared, [torch.randn_like(x) for _ in range(4)], progress=False)
    return prepared, lucid_fx.convert(prepared)


class Scaled(nn.Module):
    """A scale computed per call from a buffer (``sqrt``), beside a parameter's ``1 + weight`` (Gemma's norm)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("head_dim", torch.tensor(16.0))
        self.weight = nn.Parameter(torch.full((8,), 0.5))

    def forward(self, x):
        return torch.relu(x / self.head_dim.sqrt()) * (1.0 + self.weight)


def test_a_value_of_buffers_only_is_computed_once_and_a_parameter_s_is_not():
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 8) * 4
    prepared, converted = _quantized(model, x)
    assert "sqrt" not in _calls(prepared) and "add" in _calls(prepared)  # the parameter's sum stays: QAT trains it
    folded = [n.target for n in prepared.graph.nodes if n.op == "get_attr" and n.target.startswith(PREFIX)]
    assert len(folded) == 1 and folded[0].startswith(PREFIX + "sqrt") and float(getattr(prepared, folded[0])) == 4.0
    assert prepared.meta[_meta.REMOVED][folded[0][len(PREFIX):]] == FOLDED_REASON
    assert torch.equal(prepared(x), model(x))  # observers watch: the same values
    regions = {r.name: r.why for r in converted.lucid_fx_convert_report.float_regions}
    assert not any("sqrt" in name or "sqrt" in why for name, why in regions.items()), regions


class DebertaScale(nn.Module):
    """DeBERTa's ``scaled_size_sqrt``: ``sqrt(tensor(head_dim) * factor)``, a constant torch.export lifts."""

    def forward(self, x):
        scale = torch.sqrt(torch.tensor(x.size(-1), dtype=torch.float) * 2)
        return torch.softmax(x @ x.transpose(-1, -2) / scale, dim=-1)


def test_an_exported_constant_s_arithmetic_leaves_no_float_op_without_a_rule():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 8)
    model = DebertaScale().eval()
    ep = torch.export.export(model, (x,), strict=False)
    prepared = lucid_fx.prepare(ep, example_inputs=(x,))
    lucid_fx.calibrate(prepared, [torch.randn_like(x) for _ in range(4)], progress=False)
    converted = lucid_fx.convert(prepared)
    names = [n.name for n in prepared.graph.nodes]
    assert not any(name.startswith(("sqrt", "lift_fresh_copy", "mul")) for name in names), names
    assert {why for name, why in prepared.meta[_meta.REMOVED].items() if name.startswith(("sqrt", "mul"))} == {FOLDED_REASON}
    regions = [(r.name, r.why) for r in converted.lucid_fx_convert_report.float_regions if r.kind == "op"]
    assert not any("lowering rule" in why or "observer rule" in why for _, why in regions), regions
    sqnr = 10 * torch.log10(model(x).pow(2).mean() / (converted(x) - model(x)).pow(2).mean())
    assert float(sqnr) > 25


class Counter(nn.Module):
    """A buffer the model writes in place on every call: never a constant."""

    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x):
        self.calls.add_(1)
        return x * self.calls.clone()


def test_a_buffer_written_in_place_is_not_folded():
    x = torch.randn(2, 3)
    prepared = lucid_fx.prepare(torch.export.export(Counter().eval(), (x,), strict=False), example_inputs=(x,))
    assert not any(n.op == "get_attr" and n.target.startswith(PREFIX) for n in prepared.graph.nodes)
    first, second = prepared(x), prepared(x)
    assert torch.allclose(second - first, x)  # the count went up by one between the calls
    # And in the converted model's program (fold_signature_constants), whose first call builds it: building
    # it had run the write once more (steps 2, 1 before the fix), so the first call saw one count too many.
    lucid_fx.calibrate(prepared, [x], progress=False)
    converted = lucid_fx.convert(prepared)
    outs = [converted(x) for _ in range(3)]
    steps = [float(((b - a) / x).mean()) for a, b in zip(outs, outs[1:])]
    assert steps == pytest.approx([1.0, 1.0], abs=1e-5), steps


def test_the_folded_buffer_is_saved_with_the_model(tmp_path):
    torch.manual_seed(0)
    model, x = Scaled(), torch.randn(4, 8) * 4
    _, converted = _quantized(model, x)
    lucid_fx.save(converted, tmp_path / "scaled.pt")
    loaded = lucid_fx.load(tmp_path / "scaled.pt")
    assert torch.equal(loaded(x), converted(x))


class Rotary(nn.Module):
    """Llama's cos/sin: ``inv_freq @ positions`` of a static capture's constant positions, a matrix product."""

    def __init__(self):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False)
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        positions = torch.arange(x.shape[1]).float()[None, :, None]
        freqs = (self.inv_freq[None, None, :] * 1.0).transpose(1, 2) @ positions.transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=1).transpose(1, 2)
        return self.proj(x) * emb.cos()


def test_the_report_counts_the_folded_matrix_flops_apart():
    torch.manual_seed(0)
    model, x = Rotary(), torch.randn(2, 6, 8)
    _, converted = _quantized(model, x)
    report = converted.lucid_fx_convert_report
    assert report.folded_flops == 2 * 4 * 6  # (4, 1) @ (1, 6): one multiply-add per output
    assert report.total_flops == 2 * 2 * 6 * 8 * 8 and report.int8_flop_share == 1.0  # the projection, run per call
    assert "48 FLOP computed once at prepare, into constants" in str(report)


class BigMask(nn.Module):
    """A causal mask of constants expanded past fold_constants.MAX_BYTES before an op reads it."""

    def forward(self, x):
        causal = torch.ones(64, 64).tril() == 0  # 4 KiB
        big = causal.expand(1100, 64, 64).float() * -1e4  # 1100 x 64 x 64 float32: 18 MB
        return torch.softmax(x + big, dim=-1)


def test_a_constant_past_the_size_cap_stays_computed_per_call():
    x = torch.randn(64, 64)
    prepared = lucid_fx.prepare(torch.export.export(BigMask().eval(), (x,), strict=False), example_inputs=(x,))
    sizes = {n.target: getattr(prepared, n.target).numel() for n in prepared.graph.nodes if n.op == "get_attr" and n.target.startswith(PREFIX)}
    assert MAX_BYTES < 1100 * 64 * 64 * 4 and list(sizes.values()) == [64 * 64], sizes  # the small mask is the buffer
    assert torch.equal(prepared(x), BigMask()(x))
