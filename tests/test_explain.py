"""explain: each row names the decision, the observer, and the rules that chose it, with their reason."""

import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.rules.observers import OBSERVER_RULES
from lucid_fx.rules.ranges import RANGE_RULES


class Bounded(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        z = self.fc(x)
        return torch.sigmoid(z), (torch.tanh(z) + 1) / 2, F.relu6(z) * 0.5


def _where(rules, name):
    """The file:line of the built-in rule whose action (or range function) is ``name``."""
    for rule in rules:
        fn = getattr(rule, "action", None) or rule.fn
        if getattr(fn, "__name__", "") == name or name in getattr(rule, "ops", ()):
            return rule.where
    raise LookupError(name)


def test_a_fixed_qparams_row_gives_the_proven_interval_as_its_reason_and_both_rules():
    rows = lucid_fx.explain(lucid_fx.prepare(Bounded().eval(), example_inputs=(torch.randn(2, 4),))).by_node()
    proven = _where(OBSERVER_RULES, "_proven_interval")
    expected = {
        # node: (observer and qparams, the proven interval, the range rule that proved it)
        "sigmoid": ("[0, 1] scale=0.00390625 zp=0", "output proven in [0, 1]", _where(RANGE_RULES, "sigmoid")),
        "add": ("[0, 2] scale=0.0078125 zp=0", "output proven in [0, 2]", _where(RANGE_RULES, "add")),
        "truediv": ("[0, 1] scale=0.00390625 zp=0", "output proven in [0, 1]", _where(RANGE_RULES, "div")),
        "relu6": ("[0, 6] scale=0.0234375 zp=0", "output proven in [0, 6]", _where(RANGE_RULES, "clamp")),
        "mul": ("[0, 3] scale=0.0117188 zp=0", "output proven in [0, 3]", _where(RANGE_RULES, "mul")),
    }
    got = {n: (rows[n]["qparams"], rows[n]["reason"], rows[n]["rule"]) for n in expected}
    assert got == {n: (q, reason, f"{proven} via {via}") for n, (q, reason, via) in expected.items()}
    assert {rows[n]["kind"] for n in expected} == {"fixed"}
    assert {rows[n]["observer"] for n in expected} == {"FixedQParamsObserver"}
    # a row that is not fixed names one rule, and its own reason
    assert (rows["fc"]["kind"], rows["fc"]["rule"]) == ("statistics", _where(OBSERVER_RULES, "_statistics"))
    assert rows["fc"]["reason"] == "quantized op: calibrated grid"


def test_runs_gives_the_default_placement_and_names_measured_candidates_as_a_prediction():
    explanation = lucid_fx.explain(lucid_fx.prepare(Bounded().eval(), example_inputs=(torch.randn(2, 4),)))
    lines = {line.split()[0]: line for line in str(explanation).splitlines()[1:] if line.split()}
    # tanh is a candidate of precision="measured" (an elementwise tail) but runs int8 by default: the row says both.
    assert "table lookup (inside add's table (one lookup of fc's codes)) [precision='measured' may run it float: " \
           "elementwise region]" in lines["tanh"], lines["tanh"]
    assert "precision='measured'" not in lines["fc"]
    assert "measured faster" not in str(explanation)
