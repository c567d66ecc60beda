"""trace_model and prepare's fallback: untraceable parts stay float, their children are quantized."""

import pytest
import torch
from torch import fx, nn

import lucid_fx
from lucid_fx.passes.trace_model import TraceFailure, trace_model


class DataDependent(nn.Module):
    """A block whose forward branches on a tensor value: torch.fx cannot trace it."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc1(x)
        return self.fc2(x)


class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(8, 8)
        self.block = DataDependent()
        self.head = nn.Sequential(nn.Linear(8, 4), nn.Sigmoid())

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


def test_untraceable_submodule_becomes_a_reported_leaf():
    result = trace_model(Outer())
    assert [n.target for n in result.graph_module.graph.nodes if n.op == "call_module"] == ["stem", "block", "head.0", "head.1"]
    (entry,) = result.untraceable
    assert entry.path == "block" and entry.type_name == "DataDependent"
    assert "test_trace_model.py" in entry.source_line and "if x.sum() > 0" in entry.source_line
    assert "TraceError" in entry.error


def test_strict_names_module_line_and_fix():
    with pytest.raises(TraceFailure) as info:
        trace_model(Outer(), strict=True)
    message = str(info.value)
    assert "cannot trace block (DataDependent)" in message
    assert "if x.sum() > 0" in message and "leaf_modules=['block']" in message and "strict=False" in message
    with pytest.raises(TraceFailure, match=r"cannot trace <root> \(DataDependent\)"):
        lucid_fx.prepare(DataDependent().eval(), strict=True)


def test_prepare_quantizes_children_of_an_untraceable_submodule():
    model = Outer().eval()
    x = torch.randn(3, 8)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    assert isinstance(prepared.block, nn.Module) and not isinstance(prepared.block, fx.GraphModule)
    assert isinstance(prepared.block.fc1, fx.GraphModule) and hasattr(prepared.block.fc1, "lucid_fx_observers")
    assert [u.path for u in prepared.lucid_fx_report.float_modules] == ["block"]
    lucid_fx.calibrate(prepared, [torch.randn(3, 8) for _ in range(2)], progress=False)
    assert torch.equal(prepared(x), model(x))
    rows = lucid_fx.explain(prepared).by_node()
    assert rows["block.fc1.linear"]["kind"] == rows["block.fc2.linear"]["kind"] == "statistics"
    assert rows["block"]["kind"] == "statistics" and "input of quantized head_0" in rows["block"]["reason"]
    assert "block (DataDependent)" in str(lucid_fx.explain(prepared))


def test_untraceable_top_level_is_handled_one_level_down():
    model = DataDependent().eval()
    x = torch.randn(2, 8)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    assert type(prepared) is DataDependent
    assert isinstance(prepared.fc1, fx.GraphModule) and isinstance(prepared.fc2, fx.GraphModule)
    assert [u.path for u in prepared.lucid_fx_report.float_modules] == [""]
    assert torch.equal(prepared(x), model(x)) and torch.equal(prepared(-x), model(-x))
    assert model.fc1.__class__ is nn.Linear  # the user's model is untouched


def test_graph_module_input_is_accepted():
    gm = fx.symbolic_trace(nn.Sequential(nn.Linear(4, 4), nn.Tanh()).eval())
    prepared = lucid_fx.prepare(gm, example_inputs=(torch.randn(1, 4),))
    assert type(prepared.lucid_fx_observers["_1"]).__name__ == "FixedQParamsObserver"


def test_leaf_modules_option_keeps_a_module_whole():
    result = trace_model(Outer(), leaf_modules=["head"])
    assert [n.target for n in result.graph_module.graph.nodes if n.op == "call_module"] == ["stem", "block", "head"]


class RunningScale(nn.Module):
    """A forward that writes its own buffer on every call: torch.fx would run the write once, while tracing."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x):
        self.scale.mul_(0.5)
        return self.fc(x) * self.scale


class HoldsRunningScale(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.block = nn.Linear(8, 8), RunningScale()

    def forward(self, x):
        return self.block(self.stem(x))


def test_a_forward_that_writes_its_buffer_is_untraceable_and_its_buffer_is_put_back():
    model = HoldsRunningScale()
    result = trace_model(model)
    assert torch.equal(model.block.scale, torch.ones(8))  # the write tracing ran is undone
    assert [(u.path, u.error) for u in result.untraceable] == [(
        "block", "WritesStateInPlace: forward writes buffer 'block.scale' in place, which torch.fx runs once while "
        "tracing instead of recording it (the graph would read that one value on every call)")]
    assert [n.target for n in result.graph_module.graph.nodes if n.op == "call_module"] == ["stem", "block"]  # a leaf
    with pytest.raises(TraceFailure, match=r"block.scale' in place.*Fix: prepare with capture='export'"):
        trace_model(model, strict=True)


def test_prepare_captures_a_forward_that_writes_its_buffer_with_torch_export():
    torch.manual_seed(0)
    model, x = HoldsRunningScale().eval(), torch.randn(4, 8)
    prepared = lucid_fx.prepare(model, example_inputs=(x,))
    assert prepared.lucid_fx_report.captures == {"": "fx", "block": "export"}
    assert torch.equal(model.block.scale, torch.ones(8))  # prepare works on a copy
    block = prepared.get_submodule("block")
    assert "mul_" in [n.target for n in block.graph.nodes if n.op == "call_method"]  # the write is in the graph
    assert torch.equal(block.scale, torch.ones(8))  # prepare's own runs of it (shapes, FLOPs) are undone: was 0.125
    prepared(x)
    model(x)
    assert torch.equal(block.scale, model.block.scale) and block.scale[0] == 0.5  # and runs on every call, as the model's
