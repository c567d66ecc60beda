"""lucid_fx/rules/program_cpu_linear.py with lucid_fx/kernels/linear_add.py: a linear's float32 result read once by a
residual add (a transformer's ``x + fc2(h)``) runs on the row engine with the add inside its GEMM's float steps (the
call planned with the program: row_plan.py), the same float32 sum as the portable graph's linear then add."""

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels import cpu, linear_add, linear_row, row_plan
from lucid_fx.kernels import linear_native as ln
from lucid_fx.kernels.cpu_features import detected_cpu_features
from _program import lowered

pytestmark = pytest.mark.skipif(not cpu.onednn_available(), reason="this torch build has no oneDNN quantized ops")


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(64), nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


def _converted():
    torch.manual_seed(0)
    x = torch.randn(4, 16, 64)
    prepared = lucid_fx.prepare(Block().eval(), example_inputs=(x,))
    lucid_fx.calibrate(prepared, [x, torch.randn_like(x)])
    return lucid_fx.convert(prepared), x


def test_the_residual_add_runs_in_the_gemm_where_the_row_engine_takes_the_linear():
    qmodel, x = _converted()
    engine = linear_row.takes_row(cpu._cpu_target(), cpu._onednn_on(), "none", torch.float32, 64, 64, 128)
    if engine is None or not ln.available():
        pytest.skip(f"the row engine leaves a 64 x 128 -> 64 float linear to oneDNN on this CPU "
                    f"({detected_cpu_features().name}), or the native kernels are not loaded")
    portable, program, targets = lowered(qmodel, x)
    assert row_plan.planned_rows_add in targets and torch.add not in targets
    with pytest.MonkeyPatch.context() as mp:  # the GEMM planned with the program ran, not an unplanned route
        mp.setattr(row_plan, "linear_rows_add", lambda *a: pytest.fail("the planned GEMM declined the rows"))
        mp.setattr(linear_add, "linear_rows", lambda *a: pytest.fail("linear_rows_add took its two steps"))
        out = program(x)
    assert torch.equal(out, portable)
