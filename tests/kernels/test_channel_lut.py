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


@pytest.mark.parametrize("build", ["this CPU", "no AVX-512", "portable"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("table_dtype", [torch.uint8, torch.int8, torch.float32])
@pytest.mark.parametrize("channels", [16, 21, 48, 64])
def test_every_code_of_every_channel_on_each_build(native_build, build, dtype, table_dtype, channels):
    # Wide enough for the vector paths: channels-last pixels of 16+ channels (AVX-512 gathers, which
    # read past an entry: the last channel's top codes are there), and planes of 81 codes, a step of
    # 64 (VBMI) or 32 (AVX2) and a tail. Each channel sees all 256 codes.
    native_build(build)
    info = torch.iinfo(dtype)
    codes = torch.arange(info.min, info.max + 1).roll(channels).to(dtype)  # 256 codes, each once
    q = torch.stack([codes.roll(7 * c) for c in range(channels)]).T.reshape(256, channels, 1, 1)
    q = q.reshape(4, 64, channels).permute(0, 2, 1).reshape(4, channels, 8, 8)  # (4, C, 8, 8), all codes per channel
    q = torch.cat([q, q[:, :, :1]], 2)[:, :, :9, :8].contiguous()  # 72 codes a plane: a step and a tail
    tables = (torch.randn(channels, 256) * 100).to(table_dtype) if table_dtype == torch.float32 \
        else _codes((channels, 256), table_dtype, channels)
    for codes_in in (q, q.contiguous(memory_format=torch.channels_last), q[:, :, :1, :1].contiguous()):
        got, expected = ne.channel_lut(codes_in, tables, 1), cl.channel_lut(codes_in, tables, 1)
        assert got.stride() == codes_in.stride() and torch.equal(got, expected), (build, codes_in.stride())
    index = (q.view(torch.uint8) ^ 128).long() if dtype == torch.int8 else q.long()
    assert all(index[:, c].unique().numel() == 256 for c in range(channels))


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


@pytest.mark.parametrize("build", ["this CPU", "no AVX-512", "portable"])
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
@pytest.mark.parametrize("table_dtype", [torch.uint8, torch.int8, torch.float32])
def test_a_lookup_of_a_cat_reads_its_parts_without_the_cat(native_build, build, dtype, table_dtype):
    # DenseNet's cat -> batch norm: parts of 16, 8, 5 and 35 channels (a gather step, a tail, past a
    # step), the last channel's top codes among them (the gathers' guard at the tables' end)
    native_build(build)
    widths = (16, 8, 5, 35)
    parts = [_codes((2, c, 16, 16), dtype, i).contiguous(memory_format=torch.channels_last) for i, c in enumerate(widths)]
    top = torch.iinfo(dtype).max
    parts[-1][0, -1, 0, :3] = torch.tensor([top, top - 1, top - 2], dtype=dtype)
    tables = (torch.randn(64, 256) * 100).to(table_dtype) if table_dtype == torch.float32 else _codes((64, 256), table_dtype, 9)
    got = ne.channel_lut_cat(parts, tables)
    expected = cl.channel_lut(torch.cat(parts, 1), tables, 1)
    assert got.is_contiguous(memory_format=torch.channels_last) and torch.equal(got, expected)
    planes = [parts[0].contiguous(), *parts[1:]]  # a part in another layout: the cat, then the lookup
    assert torch.equal(ne.channel_lut_cat(planes, tables), expected)
    with pytest.raises(ValueError, match=r"takes \(64, 256\) tables"):  # tables that do not fit: the lookup's own error
        ne.channel_lut_cat(parts, tables[:63])
