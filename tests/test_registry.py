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


class LinRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.relu(self.fc(x)))


def test_a_later_user_rule_wins_over_an_earlier_one_and_over_the_built_in_one():
    from lucid_fx.rules.observers import FALLBACK_RULE, GUARD_RULES, OP_RULES

    reg = lucid_fx.current_registry().copy()
    first = lucid_fx.register_observer_rule("linear", "float", registry=reg)
    model, x = nn.Sequential(nn.Linear(4, 4)).eval(), torch.randn(2, 4)
    rows = lucid_fx.explain(lucid_fx.prepare(model, example_inputs=(x,), registry=reg)).by_node()
    assert (rows["_0"]["kind"], rows["_0"]["rule"]) == ("float", first.where)  # built-in: statistics
    second = lucid_fx.register_observer_rule("linear", "shared", registry=reg)
    rows = lucid_fx.explain(lucid_fx.prepare(model, example_inputs=(x,), registry=reg)).by_node()
    assert (rows["_0"]["kind"], rows["_0"]["rule"]) == ("shared", second.where)
    # the table is the composition, whatever the built-in tables hold: no position to get wrong
    assert reg.observer_rules == [*GUARD_RULES, second, first, *OP_RULES, FALLBACK_RULE]
    assert reg.user_observer_rules == [first, second] and lucid_fx.current_registry().user_observer_rules == []


def test_guards_still_apply_to_the_ops_of_user_rules():
    reg = lucid_fx.current_registry().copy()
    rule = lucid_fx.register_observer_rule(("linear", "relu"), "statistics", registry=reg)
    x = torch.randn(2, 4)

    def rows(mapping=None):
        prepared = lucid_fx.prepare(LinRelu().eval(), mapping, example_inputs=(x,), registry=reg)
        return {n: (r["kind"], r["rule"], r["reason"]) for n, r in lucid_fx.explain(prepared).by_node().items()}

    # inside fused linear_relu: the guard keeps fc fused; the user rule decides relu (the group's end) and head
    got = rows()
    assert got["fc"][:2] == ("fused", _where("_fused")) and got["relu"][:2] == got["head"][:2] == ("statistics", rule.where)
    # QConfig None for fc: the guard keeps it float, not the user rule
    got = rows(Q.get_default_qconfig_mapping().set_module_name("fc", None))
    assert got["fc"] == ("float", _where("_qconfig_none"), "QConfig is None for this module/op")
    # a registered float op: the guard wins over the user rule
    lucid_fx.register_float_op("linear", registry=reg)
    assert rows()["head"] == ("float", _where("_user_float"), "registered to stay float")


def _where(action: str) -> str:
    from lucid_fx.rules.observers import GUARD_RULES

    return next(rule.where for rule in GUARD_RULES if rule.action.__name__ == action)


def test_a_registered_fusion_is_one_built_with_fusion_and_the_latest_is_tried_first():
    from lucid_fx.rules.fusions import FUSION_RULES, fusion

    reg = lucid_fx.current_registry().copy()
    older = lucid_fx.register_fusion("linear_tanh", "linear", "tanh", registry=reg)
    rule = lucid_fx.register_fusion("lin_act", "linear", ("tanh", "sigmoid"), registry=reg)
    assert rule == fusion("lin_act", "linear", ("tanh", "sigmoid"), where=rule.where)
    assert rule.where.startswith("tests/test_registry.py:")  # the user's line, not registry.py's
    assert reg.fusion_rules == [rule, older, *FUSION_RULES]
    prepared = lucid_fx.prepare(
        nn.Sequential(nn.Linear(3, 3), nn.Tanh()).eval(), example_inputs=(torch.randn(2, 3),), registry=reg
    )
    assert lucid_fx.explain(prepared).by_node()["_0"]["reason"] == "inside fused lin_act ending at _1"
