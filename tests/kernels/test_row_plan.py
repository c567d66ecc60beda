"""lucid_fx/kernels/row_plan.py: a program's row-engine GEMM call planned on a meta tensor of the rows' shape runs on
rows of that shape and declines others (which take linear_rows, with the same values)."""

import math

import pytest
import torch

from lucid_fx.kernels import linear_native as ln
from lucid_fx.kernels import linear_row, row_plan


@pytest.fixture
def row(native_on):
    g = torch.Generator().manual_seed(3)
    qw = torch.randint(-128, 128, (40, 64), dtype=torch.int8, generator=g)
    return linear_row.row_linear(qw, torch.rand(40, generator=g) * 0.01 + 1e-3, torch.randn(40, generator=g), 0.02,
                                 128, 0.05, "int_mm", "none", 24)


def _codes(*shape):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(len(shape)))


def test_a_step_planned_on_a_meta_tensor_runs_rows_of_its_shape(row):
    if not ln.full_grid():
        pytest.skip("the row engine's native GEMM takes the full grid only with VNNI")
    step = row_plan.planned_step(torch.empty(2, 12, 64, dtype=torch.uint8, device="meta"), row, 7, 0, 255, torch.uint8)
    assert step is not None
    q = _codes(2, 12, 64)
    want = linear_row.linear_rows(q, row, 7, 0, 255, torch.uint8)
    assert torch.equal(step(q), want) and torch.equal(row_plan.planned_rows(q, row, step, 7, 0, 255, torch.uint8), want)
    other = _codes(3, 12, 64)  # another shape, the same strides but one: declined, the unplanned route's values
    assert step(other) is None and step(q.transpose(0, 1).contiguous().transpose(0, 1)) is None
    assert torch.equal(row_plan.planned_rows(other, row, step, 7, 0, 255, torch.uint8),
                       linear_row.linear_rows(other, row, 7, 0, 255, torch.uint8))


def test_a_planned_addend_step_adds_the_residual_and_declines_another_layout(row):
    if not ln.full_grid():
        pytest.skip("the row engine's native GEMM takes the full grid only with VNNI")
    q, r = _codes(24, 64), torch.randn(24, 40)
    step = row_plan.planned_step(torch.empty(24, 64, dtype=torch.uint8, device="meta"), row, 0, -math.inf, math.inf,
                                 torch.float32, ln.ADDEND)
    want = linear_row.linear_rows(q, row, 0, -math.inf, math.inf, torch.float32) + r
    assert torch.equal(step(q, r), want)
    transposed = r.t().contiguous().t()
    assert step(q, transposed) is None
    assert torch.equal(row_plan.planned_rows_add(q, transposed, row, step, -math.inf, math.inf), want)
