"""predict_placement: from the prepared graph alone, where convert will run each node; it agrees
with what lower_to_int8 then records."""

import torch
from torch import nn

import lucid_fx
from lucid_fx._placement import Placement, Runs
from lucid_fx.kernels.target import resolve_target
from lucid_fx.passes.lower_to_int8 import lower_to_int8, lowering_table
from lucid_fx.passes.predict_placement import predict_placement
from lucid_fx.rules.lowering_gate import GATE_WHY
from lucid_fx.quantization import default_qconfig, get_default_qconfig_mapping


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.norm = nn.Linear(8, 8), nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.norm(torch.sigmoid(self.fc2(h)) * 2.0).reshape(-1, 2, 4)


def test_prediction_before_convert_matches_what_convert_records():
    torch.manual_seed(0)
    # the layer norm as an int8 kernel (by default it runs in float where it pays: rules/observers.py)
    mapping = get_default_qconfig_mapping().set_object_type(nn.LayerNorm, default_qconfig)
    prepared = lucid_fx.prepare(Net().eval(), mapping, example_inputs=(torch.randn(2, 8),))
    lucid_fx.calibrate(prepared, [torch.randn(4, 8) for _ in range(3)], progress=False)
    registry = lucid_fx.current_registry()
    predicted = predict_placement(prepared, lowering_table(registry.lowerings, "cpu"))
    assert {name: (p.runs, p.why) for name, p in predicted.items()} == {
        "fc1": (Runs.KERNEL, "linear+relu"), "relu": (Runs.KERNEL, "linear+relu"),
        # the sigmoid reads fc2 alone: fc2's post-op (rules/lowering_gate.py)
        "fc2": (Runs.KERNEL, GATE_WHY.format(act="sigmoid")), "sigmoid": (Runs.KERNEL, "sigmoid"),
        "mul": (Runs.SHARED, "mul"),  # x * 2: the same codes on a grid twice as wide
        "norm": (Runs.KERNEL, "layer_norm"),
        "reshape": (Runs.SHARED, "shared"),  # on the norm's codes
    }
    assert predicted["fc1"] == predicted["relu"] == Placement(Runs.KERNEL, "linear+relu", ("fc1", "relu"))
    _, report = lower_to_int8(prepared, registry.lowerings, resolve_target("cpu"))
    assert report.placements == predicted


class Scaled(nn.Module):
    """Scores divided by a 0-dim constant (GPT-2's ``/ torch.full([], d ** 0.5)``) and multiplied by one."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x) / torch.full([], 4.0) * torch.full([], 0.5)


def test_a_0_dim_constant_scales_the_grid_in_the_prediction_as_in_convert():
    torch.manual_seed(0)
    prepared = lucid_fx.prepare(Scaled().eval(), example_inputs=(torch.randn(2, 8),))
    lucid_fx.calibrate(prepared, [torch.randn(4, 8) for _ in range(3)], progress=False)
    registry = lucid_fx.current_registry()
    predicted = predict_placement(prepared, lowering_table(registry.lowerings, "cpu"))
    _, report = lower_to_int8(prepared, registry.lowerings, resolve_target("cpu"))
    assert report.placements == predicted
    assert [(p.runs, p.why) for name, p in predicted.items() if name != "fc"] == [(Runs.SHARED, "div"), (Runs.SHARED, "mul")]


class ShapeScaled(nn.Module):
    """Scores scaled by a number the graph computes from a shape (``q.size(-1) ** -0.5``): no constant grid."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.out = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x):
        q = self.q(x)
        return self.out(((q @ self.k(x).transpose(1, 2)) * q.size(-1) ** -0.5).softmax(-1) @ x)


def test_a_product_by_a_computed_number_is_predicted_float_as_convert_runs_it():
    # predicted as an int8 mul kernel, it ran float: the binary rules find no codes for a number
    torch.manual_seed(0)
    prepared = lucid_fx.prepare(ShapeScaled().eval(), example_inputs=(torch.randn(2, 8, 16),))
    lucid_fx.calibrate(prepared, [torch.randn(2, 8, 16) for _ in range(3)], progress=False)
    registry = lucid_fx.current_registry()
    predicted = predict_placement(prepared, lowering_table(registry.lowerings, "cpu"))
    _, report = lower_to_int8(prepared, registry.lowerings, resolve_target("cpu"))
    assert report.placements == predicted
    assert (predicted["mul"].runs, predicted["mul"].why) == (Runs.FLOAT, "lowering declined")
