"""lucid_fx/kernels/linear_add.py: a linear's float32 result plus a residual, in the GEMM where it reads the residual in
place (contiguous, lucid_fx's GEMM loaded), else as the linear then torch.add: the same values either way."""

import math

import torch

from lucid_fx.kernels import linear_add, linear_row


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
