"""lucid_fx::channel_lut (lucid_fx/kernels/channel_lut.py): a table per channel. The CPU kernel (one C
pass, lucid_fx/kernels/native_elementwise.py) equals the reference in every layout it takes, the
batch-norm tables match the float batch norm to the output grid, and a wrong table is refused."""

import pytest
import torch
import torch.nn.functional as F

from lucid_fx.kernels import channel_lut as cl
from lucid_fx.kernels import native_elementwise as ne
from lucid_fx.kernels.checks import KernelInputError
from lucid_fx.kernels.codes import dequant, quant


def _codes(shape, dtype, seed=0):
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max + 1, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("table_dtype", [torch.uint8, torch.int8, torch.float32])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "rows", "transposed"])
def test_the_native_pass_equals_the_reference_in_the_codes_layout(native_on, dtype, table_dtype, layout):
    q = _codes((2, 5, 6, 7), dtype, 1)
    q = {"contiguous": q, "channels_last": q.contiguous(memory_format=torch.channels_last),
         "rows": q[:, :, 0, 0].contiguous(), "transposed": q.transpose(2, 3)}[layout]
    tables = (torch.randn(5, 256) * 100).to(table_dtype) if table_dtype == torch.float32 else _codes((5, 256), table_dtype, 2)
    got, expected = ne.channel_lut(q, tables, 1), cl.channel_lut(q, tables, 1)
    assert got.dtype == table_dtype and torch.equal(got, expected)
    if layout != "transposed":
        assert got.stride() == q.stride()
    # each channel reads its own table: the reference by hand
    index = (q.view(torch.uint8) ^ 128).long() if dtype == torch.int8 else q.long()
    for c in range(5):
        assert torch.equal(expected.select(1, c), tables[c][index.select(1, c)])


def test_a_table_that_does_not_fit_the_channels_is_refused():
    with pytest.raises(ValueError, match=r"takes \(3, 256\) tables for dim 1 of codes \(2, 3, 4\), got \(4, 256\)"):
        cl.channel_lut(torch.zeros(2, 3, 4, dtype=torch.uint8), torch.zeros(4, 256, dtype=torch.uint8), 1)
    with pytest.raises(KernelInputError, match=r"lucid_fx.channel_lut: the input is torch.float32, and int8 kernels read uint8 or int8 codes"):
        torch.ops.lucid_fx.channel_lut(torch.zeros(2, 3), torch.zeros(3, 256, dtype=torch.uint8), 1)


@pytest.mark.parametrize("in_range,in_zp", [((0, 255), 128), ((-128, 127), 0)])
def test_batch_norm_tables_are_the_float_batch_norm_on_the_output_grid(in_range, in_zp):
    g = torch.Generator().manual_seed(0)
    mean, var = torch.randn(6, generator=g), torch.rand(6, generator=g) + 0.1
    weight, bias = torch.randn(6, generator=g), torch.randn(6, generator=g)
    dtype = torch.uint8 if in_range[0] >= 0 else torch.int8
    q = _codes((3, 6, 4, 4), dtype, 3)
    tables = cl.batch_norm_tables(mean, var, weight, bias, 1e-5, 0.05, in_zp, in_range, 0.03, 100, (0, 255), torch.uint8)
    got = cl.channel_lut(q, tables, 1)
    y = F.batch_norm(dequant(q, 0.05, in_zp), mean, var, weight, bias, False, 0.0, 1e-5)
    expected = quant(y, 0.03, 100, 0, 255, torch.uint8)
    diff = (got.int() - expected.int()).abs()
    assert diff.max() <= 1 and diff.float().mean() < 0.01  # float32 ties only: the tables round once, in float64
