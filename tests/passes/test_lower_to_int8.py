"""lower_to_int8: a calibrated graph before and after, its report, and the Target's weight grid."""

import contextlib

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.kernels import force_cpu_features
from lucid_fx.kernels.cpu_features import detected_cpu_features
from lucid_fx.kernels.target import resolve_target
from lucid_fx.passes.lower_to_int8 import lower_to_int8
from lucid_fx.passes.lower_to_program import record_values
from lucid_fx.rules.lowering_gate import GATE_WHY


def _calibrated():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4), nn.Sigmoid(), nn.Softmin(dim=-1)).eval()
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(2, 8),))
    lucid_fx.calibrate(prepared, [torch.randn(16, 8) for _ in range(20)], progress=False)
    return model, prepared


def _calls(gm):
    return [(n.op, getattr(n.target, "__name__", str(n.target))) for n in gm.graph.nodes if n.op in ("call_function", "call_module")]


@pytest.mark.parametrize("kind, grid", [("avx2", (-64, 63)), ("avx512_vnni", (-128, 127))])
def test_graph_before_and_after(kind, grid):
    model, prepared = _calibrated()
    assert [t for op, t in _calls(prepared) if op == "call_module" and not t.startswith("lucid_fx_observers")] == ["0", "1", "2", "3", "4"]
    with force_cpu_features(kind):
        converted, report = lower_to_int8(prepared, lucid_fx.current_registry().lowerings, resolve_target("cpu"))
    # the sigmoid, the only reader of the second linear, is its post-op (rules/lowering_gate.py)
    assert _calls(converted) == [
        ("call_function", "quantize_per_tensor"), ("call_function", "linear"), ("call_function", "linear"),
        ("call_function", "dequantize_per_tensor"), ("call_module", "4"),
    ]
    assert report.backend == "cpu" and report.lowered == {"_1": "linear+relu", "_2": GATE_WHY.format(act="_3"), "_3": "sigmoid"}
    assert report.float_ops == {"_4": "no observer rule quantizes this op"}
    codes = [getattr(converted, n.target) for n in converted.graph.nodes if n.op == "get_attr" and n.target.endswith("qweight")]
    assert len(codes) == 2 and all(c.dtype == torch.int8 and grid[0] <= int(c.min()) and int(c.max()) <= grid[1] for c in codes)
    assert max(int(c.abs().max()) for c in codes) >= grid[1]  # the largest weights reach the edge of the grid
    linear = next(n for n in converted.graph.nodes if getattr(n.target, "__name__", "") == "linear")
    assert linear.meta[_meta.PLACEMENT].members == ("_0", "_1")  # the fused group, by prepared-node name
    x = torch.randn(16, 8)
    # VNNI-grid weights on a CPU without VNNI take the exact _int_mm path, saying so where the AVX2 kind is in
    # force (a model converted on a VNNI machine); a VNNI kind forced on this CPU (the suite's reruns) does not.
    warns = detected_cpu_features().name == "avx2" and grid != (-64, 63) and not resolve_target("cpu").cpu.vnni
    with pytest.warns(RuntimeWarning, match="oneDNN would saturate") if warns else contextlib.nullcontext():
        out = converted(x)
    assert (out - model(x)).abs().max() < 0.02  # softmin of sigmoid outputs, a few steps of 1/256


class ChannelSplit(nn.Module):
    """ShuffleNet's split: x.chunk(2, dim=1), one half through a conv, the halves concatenated."""

    def __init__(self):
        super().__init__()
        self.stem, self.branch = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        left, right = self.stem(x).relu().chunk(2, dim=1)
        return torch.cat([left, self.branch(right).relu()], dim=1)


def test_the_items_of_a_chunk_are_views_of_the_codes_on_the_inputs_grid():
    torch.manual_seed(0)
    model, x = ChannelSplit().eval(), torch.randn(2, 3, 8, 8)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    items = [n for n in prepared.graph.nodes if n.op == "call_function" and n.target.__name__ == "getitem"]
    assert [n.meta[_meta.DECISION].kind.value for n in items] == ["shared", "shared"]
    lucid_fx.calibrate(prepared, [x, torch.randn_like(x)], progress=False)
    q = lucid_fx.convert(prepared)
    assert set(q.lucid_fx_convert_report.float_ops) == {"cat"}  # the output: float by design, no getitem
    chunks = [n for n in q.graph.nodes if n.op == "call_method" and n.target == "chunk"]
    y, values = record_values(q, (x,))
    assert chunks and all(values[n.args[0].name].dtype == torch.uint8 for n in chunks), "the chunk reads codes"
    expected = model(x)
    sqnr = 10 * torch.log10(expected.pow(2).mean() / (y - expected).pow(2).mean())
    assert sqnr > 25, f"{sqnr:.1f} dB"


class TensorSplit(nn.Module):
    """transformers' Mamba on a CPU: ``x, gate = projected.tensor_split([n], dim)`` (uneven parts too)."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(8, 20), nn.Linear(12, 8)

    def forward(self, x):
        hidden, gate, rest = torch.tensor_split(self.proj(x), [12, 16], dim=-1)
        return self.out(hidden) + gate.sum(-1, keepdim=True) * rest.mean(-1, keepdim=True)


def test_the_items_of_a_tensor_split_are_views_of_the_codes_on_the_inputs_grid():
    torch.manual_seed(0)
    model, x = TensorSplit().eval(), torch.randn(4, 8)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    items = [n for n in prepared.graph.nodes if n.op == "call_function" and n.target.__name__ == "getitem"]
    assert [n.meta[_meta.DECISION].kind.value for n in items] == ["shared"] * 3
    lucid_fx.calibrate(prepared, [torch.randn(4, 8) for _ in range(4)], progress=False)
    q = lucid_fx.convert(prepared)
    splits = [n for n in q.graph.nodes if n.target is torch.tensor_split]
    y, values = record_values(q, (x,))
    assert splits and all(values[n.args[0].name].dtype == torch.uint8 for n in splits), "tensor_split reads codes"
    assert "tensor_split" not in q.lucid_fx_convert_report.float_ops and "getitem" not in q.lucid_fx_convert_report.float_ops
    expected = model(x)
    assert 10 * torch.log10(expected.pow(2).mean() / (y - expected).pow(2).mean()) > 25


class Unbound(nn.Module):
    """ModernBERT's attention inputs: one projection, then q, k, v = qkv.unbind(dim)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 3 * 8), nn.Linear(8, 8)

    def forward(self, x):
        q, k, v = self.qkv(x).view(x.shape[0], 3, 8).unbind(dim=1)
        return self.out(q * torch.sigmoid(k) + v)


def test_the_items_of_an_unbind_are_codes_on_the_inputs_grid():
    torch.manual_seed(0)
    model, x = Unbound().eval(), torch.randn(4, 8)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    items = [n for n in prepared.graph.nodes if n.op == "call_function" and n.target.__name__ == "getitem"
             and "unbind" in str(n.args[0].target)]
    assert [n.meta[_meta.DECISION].kind.value for n in items] == ["shared"] * 3
    lucid_fx.calibrate(prepared, [torch.randn(4, 8) for _ in range(4)], progress=False)
    q = lucid_fx.convert(prepared)
    assert not q.lucid_fx_convert_report.float_ops, q.lucid_fx_convert_report  # the items were float ops without a rule
    y, expected = q(x), model(x)
    assert 10 * torch.log10(expected.pow(2).mean() / (y - expected).pow(2).mean()) > 25


@pytest.mark.parametrize("kind", ["avx2", "avx512_vnni"])
def test_a_depthwise_convolution_takes_the_full_grid_on_every_kind(kind):
    # Its kernels sum in 32 bits on every CPU (Target.layer_weight_range): the depthwise weight reaches
    # 127 even without VNNI, where the dense one stays on [-64, 63]; the reference simulates the same codes.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
    prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(2, 8, 6, 6),))
    lucid_fx.calibrate(prepared, [torch.randn(2, 8, 6, 6) for _ in range(8)], progress=False)
    with force_cpu_features(kind):
        converted = lucid_fx.convert(prepared)
        reference = lucid_fx.convert(prepared, reference=True)
        x = torch.randn(2, 8, 6, 6)
        with torch.no_grad():
            error = float((converted(x) - reference(x)).abs().max())
    assert error < 0.05  # a few steps of the output's grid
    depthwise, dense = (getattr(converted, f"_lucid_{name}_qweight") for name in ("0", "2"))
    low, high = (-64, 63) if kind == "avx2" else (-128, 127)
    assert int(depthwise.abs().max()) >= 127
    assert low <= int(dense.min()) and int(dense.max()) <= high and max(-int(dense.min()), int(dense.max())) >= high
    for name, codes in (("0", depthwise), ("2", dense)):
        scale = getattr(converted, f"_lucid_{name}_wscale")
        simulated = reference.get_submodule(name).weight.detach()
        assert torch.allclose(simulated, codes.float() * scale.view(-1, 1, 1, 1), rtol=0, atol=1e-7), name
