"""Average pools, stack and the activations the op table once observed without lowering (or lowered
without observing): each runs in int8, within one output code of the simulated float oracle."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx


class After(nn.Module):
    """A conv (or linear) whose output the op under test reads; ``op`` is a function of it."""

    def __init__(self, op, dims: int = 2):
        super().__init__()
        self.layer = {1: nn.Conv1d(2, 4, 3), 2: nn.Conv2d(2, 4, 3), 0: nn.Linear(6, 8)}[dims]
        self.op = op

    def forward(self, x):
        return self.op(self.layer(x))


CASES = {
    "AvgPool2d": (lambda: nn.AvgPool2d(3, stride=2, padding=1, ceil_mode=True, count_include_pad=False), 2, "avg_pool2d"),
    "F.avg_pool2d": (lambda: (lambda y: F.avg_pool2d(y, 2)), 2, "avg_pool2d"),
    "AvgPool1d": (lambda: nn.AvgPool1d(3, stride=2, padding=1), 1, "avg_pool2d"),
    "AdaptiveAvgPool1d": (lambda: nn.AdaptiveAvgPool1d(3), 1, "adaptive_avg_pool2d"),
    # flattened, so that codes leave it: a stack (a cat) only dequantized runs in float (passes/fold_dequantize.py)
    "stack": (lambda: (lambda y: torch.stack([y, y * 0.5], 1).flatten(1)), 2, "cat"),
    "SiLU": (lambda: nn.SiLU(), 0, "linear"),  # after a linear: its fused post-op (rules/fusions.py)
    "GELU": (lambda: nn.GELU(), 0, "linear"),  # after a linear: its fused post-op, both forms
    "gelu tanh": (lambda: nn.GELU(approximate="tanh"), 0, "linear"),
    "GELU after a conv": (lambda: nn.GELU(), 2, "lut"),  # a table of the conv's codes
    "gelu tanh after a conv": (lambda: nn.GELU(approximate="tanh"), 2, "lut"),
}
SHAPES = {0: (3, 6), 1: (2, 2, 13), 2: (2, 2, 11, 11)}


@pytest.mark.parametrize("name", list(CASES))
def test_runs_in_int8_within_one_code_of_the_float_oracle(name):
    build, dims, kernel = CASES[name]
    torch.manual_seed(0)
    model = After(build(), dims).eval()
    batches = [torch.randn(SHAPES[dims]) for _ in range(3)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    kernels = [n.target.__name__ for n in qmodel.graph.nodes if n.op == "call_function"]
    # no float island: one quantize in; out through one dequantize, or none where the last kernel gives float
    assert kernels.count("quantize_per_tensor") == 1 and kernels.count("dequantize_per_tensor") <= 1
    assert kernel in kernels
    observer = prepared.get_submodule(list(prepared.graph.nodes)[-2].target)  # watches the op under test
    scale = observer.calculate_qparams()[0].item()
    x = batches[1]
    out, oracle = qmodel(x), lucid_fx.convert(prepared, reference=True)(x)  # reference: float ops between q/dq
    assert out.shape == oracle.shape == model(x).shape
    assert (out - oracle).abs().max().item() <= scale + 1e-6
