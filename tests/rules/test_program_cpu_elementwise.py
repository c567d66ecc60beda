"""The CPU program rules for elementwise steps (lucid_fx/rules/program_cpu_elementwise.py): each
computes the portable graph's codes bit for bit, through the route it promises."""

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels import native, native_elementwise, native_rotary
from lucid_fx.program import programs_of
from _program import called


class Concat(nn.Module):
    """Two branches on their own grids, concatenated: the cat requantizes (at least) one of them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(16, 8), nn.Linear(16, 8), nn.Linear(16, 4)

    def forward(self, x):
        return self.head(torch.cat([self.a(x), 3 * self.b(x).relu()], dim=-1))


class Rotary(nn.Module):
    """``q * cos`` with ``cos`` broadcast over heads, as Llama's rotary embedding."""

    def __init__(self):
        super().__init__()
        self.q, self.out = nn.Linear(16, 16), nn.Linear(16, 8)
        self.cos = nn.Parameter(torch.rand(1, 1, 5, 4) * 2 - 1, requires_grad=False)

    def forward(self, x):
        q = self.q(x).view(2, 5, 4, 4).transpose(1, 2)  # (batch, heads, seq, head_dim): not contiguous
        return self.out((q * self.cos).transpose(1, 2).reshape(10, 16))


def _run(model, x):
    torch.manual_seed(0)
    q = lucid_fx.quantize(model.eval(), (x,), [x, 2 * torch.randn_like(x), torch.randn_like(x)])
    portable = q(x)
    program_out = q(x)
    (program,) = programs_of(q).values()
    return portable, program_out, [called(n) for n in program.graph.nodes if n.op == "call_function"]


def test_a_cat_of_codes_on_other_grids_is_a_table_lookup_each_and_one_torch_cat():
    torch.manual_seed(0)
    portable, out, calls = _run(Concat(), torch.randn(6, 16))
    assert torch.equal(out, portable)
    assert torch.cat in calls and not any(getattr(t, "__name__", "") == "cat" and t is not torch.cat for t in calls)


@pytest.mark.parametrize("dtype_name", ["uint8", "int8"])
def test_the_cat_tables_requantize_every_code_as_the_reference_does(dtype_name):
    from lucid_fx.kernels import reference as ref
    from lucid_fx.rules.program_cpu_elementwise import _all_codes

    dtype = getattr(torch, dtype_name)
    codes = _all_codes(dtype)
    assert codes.numel() == 256 and int(codes[0]) == torch.iinfo(dtype).min
    table = ref.cat([codes], [0.037], [5], 0, 0.05, -3 if dtype == torch.int8 else 120)
    q = torch.randint(torch.iinfo(dtype).min, torch.iinfo(dtype).max + 1, (4, 33)).to(dtype)
    expected = ref.cat([q], [0.037], [5], 0, 0.05, -3 if dtype == torch.int8 else 120)
    assert torch.equal(ref.lut(q, table), expected)


def test_a_broadcast_product_of_strided_codes_runs_in_one_native_pass():
    torch.manual_seed(0)
    portable, out, calls = _run(Rotary(), torch.randn(10, 16))
    assert torch.equal(out, portable)
    if native.available():  # the rerun with LUCID_FX_NATIVE=0 (tests/test_every_cpu_kind.py) checks the torch route
        assert native_elementwise.mul_codes in calls
    else:
        assert native_elementwise.mul_codes not in calls


class ChannelsLastNorm(nn.Module):
    """ConvNeXt's conv -> permute -> LayerNorm: the norm runs in float, after a dequantize."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv2d(4, 8, 3, padding=1), nn.LayerNorm(8)

    def forward(self, x):
        return self.norm(self.conv(x).permute(0, 2, 3, 1))


def test_a_dequantize_at_the_float_boundary_is_one_native_pass():
    torch.manual_seed(0)
    portable, out, calls = _run(ChannelsLastNorm(), torch.randn(2, 4, 6, 6))
    assert torch.equal(out, portable)
    names = [getattr(t, "__name__", "") for t in calls]
    assert "dequantize_per_tensor" in names or "dequantize_codes" in names
    assert ("dequantize_codes" in names) == native.available()


class RotateHalf(nn.Module):
    """Llama's rotary embedding: ``q * cos + rotate_half(q) * sin``, cos and sin broadcast over heads."""

    def __init__(self, rotated_first=False):
        super().__init__()
        self.q, self.out, self.rotated_first = nn.Linear(16, 16), nn.Linear(16, 8), rotated_first
        angles = torch.arange(5.0)[:, None] * torch.tensor([1.0, 0.3])[None]
        angles = torch.cat([angles, angles], dim=-1)  # (seq, head_dim), as llama's
        self.cos = nn.Parameter(angles.cos()[None, None], requires_grad=False)  # (1, 1, 5, 4)
        self.sin = nn.Parameter(angles.sin()[None, None], requires_grad=False)

    def forward(self, x):
        q = self.q(x).view(2, 5, 4, 4).transpose(1, 2)  # (batch, heads, seq, head_dim): not contiguous
        rotated = torch.cat((-q[..., 2:], q[..., :2]), dim=-1)
        y = rotated * self.sin + q * self.cos if self.rotated_first else q * self.cos + rotated * self.sin
        return self.out(y.transpose(1, 2).reshape(10, 16))


@pytest.mark.parametrize("rotated_first", [False, True], ids=["x*cos first", "rotated first"])
def test_a_rotary_embedding_is_one_native_call(rotated_first):
    torch.manual_seed(0)
    portable, out, calls = _run(RotateHalf(rotated_first), torch.randn(10, 16))
    assert torch.equal(out, portable)
    fused = native.available() and native_elementwise.fused_add()
    assert (native_rotary.rotary_codes in calls) == fused
    if fused:  # the products, lookups, cat and sum it replaces are gone
        assert calls.count(native_rotary.rotary_codes) == 1 and native_elementwise.mul_codes not in calls
        assert torch.cat not in calls and native_elementwise.add_codes not in calls
