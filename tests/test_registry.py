"""Custom registration: bounded ops, fusions, float ops, observer rules; scoped; later wins."""

import pytest
import torch
from torch import nn

import lucid_fx
import lucid_fx.quantization as Q


def my_gate(x):
    return torch.sigmoid(x) * torch.sigmoid(x + 1)


class Gate(nn.Module):
    def forward(self, x):
        return x.clamp(-3, 3) / 3


class UsesGate(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.gate = Gate()

    def forward(self, x):
        z = self.fc(x)
        return my_gate(z), self.gate(z), torch.tanh(z)


def _kinds(prepared):
    return {name: row["kind"] for name, row in lucid_fx.explain(prepared).by_node().items()}


def test_bounded_function_and_module_get_fixed_observers():
    with lucid_fx.registry_scope():
        lucid_fx.register_bounded_op(my_gate, (0.0, 1.0))
        lucid_fx.register_bounded_op(Gate, (-1.0, 1.0))
        prepared = lucid_fx.prepare(UsesGate().eval(), example_inputs=(torch.randn(2, 4),))
    obs = prepared.lucid_fx_observers
    assert (obs["my_gate"].scale.item(), obs["my_gate"].zero_point.item()) == (1 / 256, 0)
    assert (obs["gate"].scale.item(), obs["gate"].zero_point.item()) == (2 / 256, 128)
    row = lucid_fx.explain(prepared).by_node()["my_gate"]
    assert "tests/test_registry.py:" in row["rule"]  # the registration is the rule that fired
    assert row["spelling"] == f"{my_gate.__module__}.my_gate"  # the user's function, not "torch.my_gate"
    assert lucid_fx.explain(prepared).by_node()["gate"]["spelling"] == "Gate"
    # outside the scope nothing leaked: my_gate is traced through again
    plain = lucid_fx.prepare(UsesGate().eval(), example_inputs=(torch.randn(2, 4),))
    assert "my_gate" not in dict(plain.lucid_fx_observers)


def test_later_registration_overrides_builtin():
    with lucid_fx.registry_scope():
        lucid_fx.register_bounded_op("tanh", (-2.0, 2.0))
        prepared = lucid_fx.prepare(UsesGate().eval(), example_inputs=(torch.randn(2, 4),))
    assert prepared.lucid_fx_observers["tanh"].scale.item() == 4 / 256


def test_float_op_and_observer_rule_and_fusion():
    reg = lucid_fx.current_registry().copy()
    lucid_fx.register_float_op(torch.tanh, registry=reg)
    lucid_fx.register_observer_rule("linear", "float", registry=reg)
    prepared = lucid_fx.prepare(UsesGate().eval(), example_inputs=(torch.randn(2, 4),), registry=reg)
    rows = lucid_fx.explain(prepared).by_node()
    assert rows["tanh"]["kind"] == "float" and rows["tanh"]["reason"] == "registered to stay float"
    # fc runs in float, but the quantized ops reading it need its output observed
    assert rows["fc"]["reason"].startswith("input of quantized") and "registered rule: float" in rows["fc"]["reason"]
    prepared(torch.randn(2, 4))
    converted = lucid_fx.convert(prepared, registry=reg)
    assert [n.target for n in converted.graph.nodes if n.op == "call_module"] == ["fc"]  # and it does run float
    assert "tanh" not in lucid_fx.current_registry().float_ops  # explicit registry: global untouched

    reg2 = lucid_fx.current_registry().copy()
    lucid_fx.register_fusion("linear_tanh", "linear", "tanh", registry=reg2)

    class LinTanh(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            return torch.tanh(self.fc(x))

    prepared = lucid_fx.prepare(LinTanh().eval(), example_inputs=(torch.randn(2, 3),), registry=reg2)
    kinds = _kinds(prepared)
    assert kinds["fc"] == "fused" and kinds["tanh"] == "fixed"


def test_registration_errors():
    with lucid_fx.registry_scope():
        with pytest.raises(ValueError, match="interval must have lo < hi"):
            lucid_fx.register_bounded_op(my_gate, (1.0, 0.0))
        with pytest.raises(ValueError, match="a pattern needs at least two ops"):
            lucid_fx.register_fusion("solo", "linear")
        with pytest.raises(ValueError, match="action must be 'statistics', 'shared', 'float' or a function"):
            lucid_fx.register_observer_rule("linear", "maybe")
