"""lucid_fx/rules/program_cpu_linear.py with lucid_fx/kernels/linear_add.py: a linear's float32 result read once by a
residual add (a transformer's ``x + fc2(h)``) runs on the row engine with the add inside its GEMM's float steps, the
same float32 sum as the portable graph's linear then add."""

import math

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels import cpu, linear_add, linear_row
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
    assert linear_add.linear_rows_add in targets and torch.add not in targets
    with pytest.MonkeyPatch.context() as mp:  # the fused GEMM ran, not the fallback's two steps
        mp.setattr(linear_add, "linear_rows", lambda *a: pytest.fail("linear_rows_add took its two steps"))
        out = program(x)
    assert torch.equal(out, portable)


def test_linear_rows_add_takes_two_steps_for_an_addend_it_cannot_read_in_place():
    g = torch.Generator().manual_seed(1)
    qw = torch.randint(-128, 128, (48, 64), dtype=torch.int8, generator=g)
    row = linear_row.row_linear(qw, torch.rand(48, generator=g) * 0.01 + 1e-3, torch.randn(48, generator=g), 0.02, 128,
                                None, "int_mm", "none", 20)
    q = torch.randint(0, 256, (20, 64), dtype=torch.uint8, generator=g)
    other = torch.randn(48, 20, generator=g).t()  # the result's shape, transposed strides
    got = linear_add.linear_rows_add(q, other, row, -math.inf, math.inf)
    want = linear_row.linear_rows(q, row, 0, -math.inf, math.inf, torch.float32) + other
    assert torch.equal(got, want)
    fused = linear_add.linear_rows_add(q, other.contiguous(), row, -math.inf, math.inf)
    assert torch.equal(fused, want)
