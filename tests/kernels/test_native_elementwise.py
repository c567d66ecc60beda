"""lucid_fx/kernels/native_elementwise.py: the one-pass product of broadcast code tensors, the
one-pass dequantize and the quantize straight to channels-last give program_ops' and the reference
kernel's values bit for bit, in the layout the program recorded, and fall back to them where the
native kernels are off or the strides moved."""

import pytest
import torch

from lucid_fx.kernels import native_elementwise as ne
from lucid_fx.kernels import program_ops
from lucid_fx.kernels import reference as ref


def _codes(shape, dtype, seed):
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max + 1, shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _out_like(a, b):
    """The output torch's own product gives (its shape and strides), as the program recorded it."""
    return torch.mul(a.to(torch.float32), b.to(torch.float32))


CASES = {
    "same shape": (lambda d: (_codes((2, 4, 16, 16), d, 0), _codes((2, 4, 16, 16), d, 1))),
    "rotary q * cos": (lambda d: (_codes((2, 4, 16, 16), d, 0), _codes((1, 1, 16, 16), d, 1))),
    "transposed heads": (lambda d: (_codes((2, 16, 4, 16), d, 0).transpose(1, 2), _codes((1, 1, 16, 16), d, 1))),
    "layer scale, channels-last": (lambda d: (_codes((2, 8, 5, 5), d, 0).contiguous(memory_format=torch.channels_last),
                                              _codes((8, 1, 1), d, 1))),
    "row vector": (lambda d: (_codes((3, 7), d, 0), _codes((7,), d, 1))),
    "both broadcast": (lambda d: (_codes((3, 1, 5), d, 0), _codes((1, 4, 1), d, 1))),
    "six dims": (lambda d: (_codes((2, 1, 3, 2, 1, 4), d, 0), _codes((1, 2, 1, 2, 3, 4), d, 1))),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype,zps,out_zp", [(torch.uint8, (128, 3), 100), (torch.uint8, (0, 255), 7),
                                              (torch.int8, (0, -5), 0), (torch.int8, (3, 0), -1)])
def test_the_product_equals_program_ops_bit_for_bit_in_the_recorded_layout(native_on, case, dtype, zps, out_zp):
    a, b = CASES[case](dtype)
    low, high = program_ops.code_bounds(dtype, out_zp, "none")
    plan = ne.broadcast_plan(a, b, _out_like(a, b))
    assert plan is not None
    for mult in (0.0123, 1.0 / 3, 0.5):  # 0.5 puts products on exact ties
        got = ne.mul_codes(a, zps[0], b, zps[1], mult, out_zp, low, high, dtype, plan)
        expected = program_ops.mul_codes(a, zps[0], b, zps[1], mult, out_zp, low, high, dtype)
        assert got.stride() == expected.stride() and got.dtype == dtype
        assert torch.equal(got, expected), f"{int((got != expected).sum())} codes differ"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("dtype,zps,out_zp", [(torch.uint8, (128, 3), 100), (torch.int8, (0, -5), 0), (torch.int8, (3, 0), -1)])
def test_the_sum_equals_program_ops_bit_for_bit_in_the_recorded_layout(native_on, case, dtype, zps, out_zp):
    if not ne.fused_add():
        pytest.skip("this torch's add rounds twice (DEFAULT CPU kernels): programs keep program_ops.add_codes")
    a, b = CASES[case](dtype)
    low, high = program_ops.code_bounds(dtype, out_zp, "none")
    plan = ne.broadcast_plan(a, b, _out_like(a, b))
    for a_mult, b_mult in ((0.9883788483913524, 0.8654469443651346), (1.0 / 3, 2.0 / 3), (0.5, 0.25), (1.7, 0.031)):
        got = ne.add_codes(a, zps[0], a_mult, b, zps[1], b_mult, out_zp, low, high, dtype, plan)
        expected = program_ops.add_codes(a, zps[0], a_mult, b, zps[1], b_mult, out_zp, low, high, dtype)
        assert got.stride() == expected.stride() and got.dtype == dtype
        assert torch.equal(got, expected), f"{int((got != expected).sum())} codes differ"


def test_torch_adds_with_one_rounding_where_fused_add_says_so():
    # The premise of native add_codes: torch.add(x, y, alpha=m) is fma(y, m, x) rounded once, for every
    # length (vector body and tail), stride and broadcast. float64 holds y * m exactly, so rounding
    # x + y * m from float64 to float32 is the one rounding of a fused multiply-add (ties aside).
    torch.manual_seed(0)
    x, y = torch.randn(1003) * 100, torch.randint(-255, 256, (1003,)).to(torch.float32)
    m = torch.tensor(0.8654469443651346, dtype=torch.float32)
    fused = (x.double() + y.double() * m.double()).float()
    twice = x + y * m
    for got in (torch.add(x, y, alpha=float(m)), torch.add(x[::2], y[::2], alpha=float(m)),
                torch.add(x.view(-1, 1), y.view(-1, 1).expand(-1, 3), alpha=float(m))[:, 2]):
        n = got.numel()
        assert torch.equal(got, fused[::2] if n < 1003 else fused) == ne.fused_add()
    assert not torch.equal(twice, fused)  # the two roundings are told apart on these values


def test_relu_bounds_and_an_operand_with_other_strides_than_planned(native_on):
    a, b = _codes((2, 4, 16, 16), torch.uint8, 0), _codes((1, 1, 16, 16), torch.uint8, 1)
    low, high = program_ops.code_bounds(torch.uint8, 90, "relu")
    plan = ne.broadcast_plan(a, b, _out_like(a, b))
    got = ne.mul_codes(a, 128, b, 128, 0.01, 90, low, high, torch.uint8, plan)
    assert int(got.min()) >= 90 and torch.equal(got, program_ops.mul_codes(a, 128, b, 128, 0.01, 90, low, high, torch.uint8))
    moved = a.transpose(2, 3)  # not what the plan was built for: the torch kernels, the same values
    got = ne.mul_codes(moved, 128, b, 128, 0.01, 90, low, high, torch.uint8, plan)
    assert torch.equal(got, program_ops.mul_codes(moved, 128, b, 128, 0.01, 90, low, high, torch.uint8))


def test_no_plan_past_six_dims_or_for_shapes_that_do_not_broadcast():
    a = torch.zeros((1,) * 7, dtype=torch.uint8)
    assert ne.broadcast_plan(a, a, a) is None
    a, b = torch.zeros(3, 4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    assert ne.broadcast_plan(a, b, torch.zeros(2, 3, 4)) is None


def test_without_the_native_kernels_the_torch_kernels_run(native_env):
    native_env(LUCID_FX_NATIVE="0")
    a, b = _codes((2, 4, 16, 16), torch.uint8, 0), _codes((1, 1, 16, 16), torch.uint8, 1)
    plan = ne.broadcast_plan(a, b, _out_like(a, b))
    assert torch.equal(ne.mul_codes(a, 1, b, 2, 0.1, 3, 0, 255, torch.uint8, plan),
                       program_ops.mul_codes(a, 1, b, 2, 0.1, 3, 0, 255, torch.uint8))
    q = _codes((3, 5), torch.int8, 2)
    assert torch.equal(ne.dequantize_codes(q, 0.1, 4), ref.dequantize_per_tensor(q, 0.1, 4))


@pytest.mark.parametrize("dtype,zp", [(torch.uint8, 128), (torch.uint8, 0), (torch.int8, -3), (torch.int8, 0)])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "transposed", "sliced"])
def test_dequantize_equals_the_reference_bit_for_bit_in_its_layout(native_on, dtype, zp, layout):
    q = _codes((2, 6, 7, 9), dtype, 3)
    q = {"contiguous": q, "channels_last": q.contiguous(memory_format=torch.channels_last),
         "transposed": q.transpose(1, 3), "sliced": q[:, ::2]}[layout]
    for scale in (0.0371, 1.0 / 3, 2.0 ** -7):
        got, expected = ne.dequantize_codes(q, scale, zp), ref.dequantize_per_tensor(q, scale, zp)
        assert got.dtype == torch.float32 and got.stride() == expected.stride()
        assert torch.equal(got, expected)


@pytest.mark.parametrize("build", ["this CPU", "portable"])
@pytest.mark.parametrize("dtype,zp,low,high", [(torch.uint8, 128, 0, 255), (torch.int8, -3, -128, 127), (torch.uint8, 0, 0, 15)])
@pytest.mark.parametrize("shape", [(2, 3, 17, 19), (1, 1, 9, 9), (1, 40, 8, 8)])  # an odd image; one channel; past a block
def test_an_image_is_quantized_straight_to_channels_last_codes(native_build, build, dtype, zp, low, high, shape):
    from lucid_fx.kernels import native

    native_build(build)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, 0, :3] = torch.tensor([1e30, -1e30, 0.05])  # clamped both ways, and a tie at scale 0.1
    got = ne.quantize_channels_last(x, 10.0, zp, low, high, dtype)
    expected = native.quantize_codes(x, 10.0, zp, low, high, dtype).contiguous(memory_format=torch.channels_last)
    assert got.is_contiguous(memory_format=torch.channels_last)  # (one channel: either stride of it)
    assert torch.equal(got, expected) and torch.equal(got, ref.quantize_per_tensor(x, 0.1, zp, low, high, dtype))


def test_a_nonfinite_image_is_refused_naming_the_count(native_on):
    from lucid_fx.kernels.checks import KernelInputError

    x = torch.randn(1, 3, 8, 8)
    x[0, 2, 7, 7] = float("nan")
    with pytest.raises(KernelInputError, match=r"NaN or ±inf in 1 of its 192 elements.*torch.nan_to_num"):
        ne.quantize_channels_last(x, 10.0, 128, 0, 255, torch.uint8)
    planes = torch.randn(1, 3, 8, 8).transpose(2, 3)  # not contiguous: quantized, then copied
    got = ne.quantize_channels_last(planes, 10.0, 128, 0, 255, torch.uint8)
    assert got.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(got, ref.quantize_per_tensor(planes, 0.1, 128, 0, 255, torch.uint8))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_a_planned_quantize_to_channels_last_gives_the_unplanned_codes(native_on, dtype):
    x = torch.randn(2, 5, 7, 3) * 4
    lo, hi = (0, 255) if dtype == torch.uint8 else (-128, 127)
    step = ne.quantize_channels_last_plan(x, 12.5, 3, lo, hi, dtype)
    expected = ne.quantize_channels_last(x, 12.5, 3, lo, hi, dtype)
    got = step(x)
    assert torch.equal(got, expected) and got.stride() == expected.stride() == (105, 1, 15, 5)  # channels-last
    assert step(x.contiguous(memory_format=torch.channels_last)) is None  # other strides: the checked path
    assert step(torch.randn(1, 5, 7, 3)) is None
    x[1, 2, 3, 1] = float("nan")
    assert step(x) is None  # the kernel counted a non-finite value
    with pytest.raises(Exception, match="NaN"):
        ne.quantize_channels_last(x, 12.5, 3, lo, hi, dtype, plan=step)
