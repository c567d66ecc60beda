"""lucid_fx/kernels/cuda_fused.py: the Triton kernels (a GEMM's operand and epilogue, quantize, dequantize,
table lookups, elementwise add and mul, global average) against the torch ops they replace. On a GPU they run compiled on CUDA tensors; without one, in Triton's interpreter on CPU tensors
(TRITON_INTERPRET=1, set for each test alone). Triton ships with torch's CUDA builds; where it is not
installed (CPU-only torch, as in CI) this module is skipped, and the CUDA kernels run as torch ops."""

import pytest
import torch

pytest.importorskip("triton", reason="needs Triton (it ships with torch's CUDA builds)")

from lucid_fx.kernels import KernelInputError, cuda, cuda_fused, finite, int_mm  # noqa: E402
from lucid_fx.kernels import reference as ref  # noqa: E402
from lucid_fx.kernels.codes import POST_OPS  # noqa: E402

DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture(autouse=True)
def triton_kernels(monkeypatch):
    """Compiled kernels on a GPU; interpreted ones on the CPU, for this test only (the CPU's int_mm
    kernels would otherwise take the interpreted ones after it)."""
    if DEV.type == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    cuda_fused._triton.cache_clear()
    yield
    cuda_fused._triton.cache_clear()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _torch_epilogue(acc, correction, rows, x_scale, w_scale, bias, post_op, out_scale, out_zp, dtype, other=None):
    y = int_mm._rescale(acc + correction * rows, x_scale, w_scale, bias)
    if other is not None:
        y = y + ref.dequantize_per_tensor(*other)
    return ref.finish(y, post_op, out_scale, out_zp, dtype)


def _codes_within_one(out, expected, exact):
    assert out.dtype == expected.dtype and out.shape == expected.shape
    diff = (out.cpu().int() - expected.cpu().int()).abs()
    assert int(diff.max()) <= (0 if exact else 1), f"{int((diff > 0).sum())} codes differ, by up to {int(diff.max())}"
    return int((diff > 0).sum())


@pytest.mark.parametrize("post_op", POST_OPS)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float32])
def test_the_epilogue_computes_what_the_torch_ops_compute(post_op, dtype):
    wide = torch.randint(-40000, 40000, (37, 24), dtype=torch.int32, generator=_gen(0))
    acc = wide[:, :19]  # a view of a padded product: strided rows
    rows = torch.randint(-3000, 3000, (19,), dtype=torch.int32, generator=_gen(1))
    w_scale = torch.rand(19, generator=_gen(2)) * 1e-3 + 1e-4
    bias = torch.randn(19, generator=_gen(3))
    args = (acc, 11, rows, 0.0173, w_scale, bias, post_op, 0.0391, 3 if dtype == torch.int8 else 128, dtype)
    expected = _torch_epilogue(*args)
    out = cuda_fused.gemm_epilogue(*(a.to(DEV) if torch.is_tensor(a) else a for a in args))
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), expected, rtol=2e-6, atol=2e-6)
    else:
        # none, relu and hardswish take the torch ops' steps exactly (in the interpreter; a GPU may fuse a
        # multiply-add); the transcendental post-ops' formulas may land a tie one code off
        exact = post_op in ("none", "relu", "hardswish") and DEV.type == "cpu"
        _codes_within_one(out, expected, exact)
        assert len(torch.unique(expected)) > 20, "the test's values spread over the grid"


def test_the_epilogue_adds_a_residual_of_any_strides_and_may_have_no_bias():
    acc = torch.randint(-40000, 40000, (50, 16), dtype=torch.int32, generator=_gen(4))
    rows = torch.randint(-3000, 3000, (16,), dtype=torch.int32, generator=_gen(5))
    w_scale = torch.rand(16, generator=_gen(6)) * 1e-3
    codes = torch.randint(0, 256, (16, 50), dtype=torch.uint8, generator=_gen(7)).t()  # column-major
    other = (codes, 0.0519, 120)
    expected = _torch_epilogue(acc, -5, rows, 0.02, w_scale, None, "relu", 0.0811, 100, torch.uint8, other)
    out = cuda_fused.gemm_epilogue(acc.to(DEV), -5, rows.to(DEV), 0.02, w_scale.to(DEV), None, "relu", 0.0811, 100,
                                   torch.uint8, (codes.to(DEV), 0.0519, 120))
    _codes_within_one(out, expected, exact=DEV.type == "cpu")
    assert int((expected == 100).sum()) > 50, "relu clipped some outputs at the zero point"


def test_quantize_rounds_half_to_even_and_keeps_the_memory_format():
    ties = torch.arange(-300, 300, dtype=torch.float32) * 0.5 * 0.25  # every k + 0.5 code, beyond the grid too
    x = torch.cat([ties, torch.randn(4000, generator=_gen(8)) * 20]).reshape(2, 4, 23, -1)
    x = x.contiguous(memory_format=torch.channels_last)
    for zp, (qmin, qmax), dtype in [(128, (0, 255), torch.uint8), (-3, (-128, 127), torch.int8), (0, (-64, 63), torch.int8)]:
        expected = ref.quantize_per_tensor(x, 0.25, zp, qmin, qmax, dtype)
        out = cuda_fused.quantize(x.to(DEV), 0.25, zp, qmin, qmax, dtype)
        assert torch.equal(out.cpu(), expected) and out.is_contiguous(memory_format=torch.channels_last)
    strided = x.to(DEV)[:, :, ::2]
    assert torch.equal(cuda_fused.quantize(strided, 0.1, 7, 0, 255, torch.uint8).cpu(),
                       ref.quantize_per_tensor(x[:, :, ::2], 0.1, 7, 0, 255, torch.uint8))


@pytest.mark.skipif(DEV.type == "cuda", reason="on CUDA the refusal is a device-side assert, which ends the process")
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_quantize_refuses_nan_and_inf_naming_the_count(bad):
    x = torch.randn(3000, generator=_gen(9))
    x[2999] = bad
    with pytest.raises(KernelInputError, match="holds NaN or ±inf in 1 of its 3000 elements"):
        cuda_fused.quantize(x, 0.05, 128, 0, 255, torch.uint8)
    ok = torch.ones((), dtype=torch.int32)
    finite.assert_finite_flag("quantize_per_tensor", x[:10], ok)  # a set flag passes


def _act(shape, seed):
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=_gen(seed))


def _both(fn, *args):
    """``fn(*args)`` through the fused kernels (asserting it took them) and through torch ops (FUSED off), on DEV."""
    args = [a.to(DEV) if torch.is_tensor(a) else a for a in args]
    calls, epilogue = [], cuda_fused.gemm_epilogue
    cuda_fused.gemm_epilogue = lambda *a, **k: calls.append(a) or epilogue(*a, **k)
    try:
        fused = fn(*args)
    finally:
        cuda_fused.gemm_epilogue = epilogue
    assert len(calls) == 1, "the op took the fused epilogue"
    cuda_fused.FUSED = False
    try:
        plain = fn(*args)
    finally:
        cuda_fused.FUSED = True
    return fused, plain


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_a_linear_takes_the_fused_epilogue(rows):
    qw = torch.randint(-127, 128, (24, 40), dtype=torch.int8, generator=_gen(10))
    w_scale, bias = torch.rand(24, generator=_gen(11)) * 0.01, torch.randn(24, generator=_gen(12))
    fused, plain = _both(cuda._cuda_linear, _act((rows, 40), 13), 0.02, 117, qw, w_scale, bias, 0.05, 90, "relu",
                         None)
    assert fused.shape == (rows, 24) and fused.dtype == torch.uint8
    _codes_within_one(fused, plain, exact=DEV.type == "cpu")


@pytest.mark.parametrize("stride,padding", [(1, 1), (2, 0)])
def test_convolutions_take_the_fused_epilogue_with_their_residual(stride, padding):
    qx, qw = _act((2, 8, 9, 10), 14), torch.randint(-127, 128, (16, 8, 3, 3), dtype=torch.int8, generator=_gen(15))
    w_scale, bias = torch.rand(16, generator=_gen(16)) * 0.01, torch.randn(16, generator=_gen(17))
    conv = (0.03, 120, qw, w_scale, bias, [stride] * 2, [padding] * 2, [1, 1], 1)
    fused, plain = _both(cuda._cuda_conv, qx, *conv, 0.1, 100, "hardswish", None)
    _codes_within_one(fused, plain, exact=DEV.type == "cpu")
    other = _act(tuple(plain.shape), 18)
    fused, plain = _both(cuda._conv2d_add, qx, *conv, other, 0.05, 128, 0.1, 100, "relu", None)
    _codes_within_one(fused, plain, exact=DEV.type == "cpu")
    assert fused.shape == plain.shape and len(torch.unique(plain)) > 20
    fused, plain = _both(cuda._cuda_conv, qx[:, :, 0], 0.03, 120, qw[:, :, 1], w_scale, None, [stride], [padding],
                         [1], 1, 0.1, 100, "none", torch.float32)  # conv1d, float out
    torch.testing.assert_close(fused, plain, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("groups", [2, 8])
@pytest.mark.parametrize("images,channels_last", [(1, False), (2, False), (2, True)])
def test_grouped_convolutions_take_the_fused_epilogue_in_the_input_s_layout(groups, images, channels_last):
    qx = _act((images, 8, 9, 10), 19)
    qx = qx.contiguous(memory_format=torch.channels_last) if channels_last else qx
    qw = torch.randint(-127, 128, (8, 8 // groups, 3, 3), dtype=torch.int8, generator=_gen(20))
    w_scale, bias = torch.rand(8, generator=_gen(21)) * 0.01, torch.randn(8, generator=_gen(22))
    fused, plain = _both(cuda._cuda_conv, qx, 0.03, 120, qw, w_scale, bias, [1, 1], [1, 1], [1, 1], groups, 0.08,
                         110, "relu", None)
    _codes_within_one(fused, plain, exact=DEV.type == "cpu")
    assert fused.stride() == plain.stride() and len(torch.unique(plain)) > 20


def _codes(shape, seed, dtype=torch.uint8):
    low, high = (0, 256) if dtype == torch.uint8 else (-128, 128)
    return torch.randint(low, high, shape, dtype=dtype, generator=_gen(seed))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_dequantize_and_lookup_keep_the_codes_layout(dtype):
    q = _codes((2, 5, 6, 7), 23, dtype).contiguous(memory_format=torch.channels_last)
    out = cuda_fused.dequantize(q.to(DEV), 0.0371, 9 if dtype == torch.uint8 else -2)
    expected = ref.dequantize_per_tensor(q, 0.0371, 9 if dtype == torch.uint8 else -2)
    assert torch.equal(out.cpu(), expected) and out.stride() == expected.stride()
    for table in (_codes((256,), 24), torch.randn(256, generator=_gen(25))):
        out = cuda_fused.lut(q.to(DEV), table.to(DEV))
        expected = ref.lut(q, table)
        assert torch.equal(out.cpu(), expected) and out.stride() == expected.stride() and out.dtype == table.dtype
    transposed = q.to(DEV).transpose(1, 3)  # neither layout: a contiguous copy first
    assert torch.equal(cuda_fused.dequantize(transposed, 0.5, 1).cpu(), ref.dequantize_per_tensor(q.transpose(1, 3), 0.5, 1))


BROADCASTS = [
    ((2, 16, 5, 5), (2, 16, 5, 5), True, True),  # a residual, channels-last
    ((2, 16, 5, 5), (2, 16, 1, 1), True, False),  # squeeze-excite's gate
    ((4, 33), (33,), False, False),  # a bias-like row
    ((3, 1, 7), (1, 5, 1), False, False),  # both broadcast
    ((6,), (6,), False, False),
]


@pytest.mark.parametrize("a_shape,b_shape,a_cl,b_cl", BROADCASTS)
@pytest.mark.parametrize("mul", [False, True])
def test_add_and_mul_broadcast_as_the_torch_ops_do(a_shape, b_shape, a_cl, b_cl, mul):
    qa, qb = _codes(a_shape, 26), _codes(b_shape, 27)
    qa = qa.contiguous(memory_format=torch.channels_last) if a_cl else qa
    qb = qb.contiguous(memory_format=torch.channels_last) if b_cl else qb
    args = (qa, 0.043, 120, qb, 0.031, 131, 0.07 if mul else 0.05, 128, "relu")
    expected = (ref.mul if mul else ref.add)(*args)
    out = cuda_fused.binary(mul, *(a.to(DEV) if torch.is_tensor(a) else a for a in args))
    _codes_within_one(out, expected, exact=DEV.type == "cpu")
    assert out.stride() == expected.stride(), "the fake kernel's strides"
    assert len(torch.unique(expected)) > min(20, expected.numel() // 4)


def test_more_than_four_dims_are_left_to_the_torch_ops():
    q = _codes((2, 1, 2, 1, 2), 28).to(DEV)
    assert cuda_fused.binary(False, q, 0.1, 0, q, 0.1, 0, 0.2, 0, "none") is None


def test_the_cuda_registrations_take_the_fused_kernels(monkeypatch):
    from lucid_fx.kernels.library import KERNELS
    q = _codes((3, 64), 29).to(DEV)
    kernels = {name: KERNELS[name]["cuda"] for name in ("add", "mul", "lut", "dequantize_per_tensor", "quantize_per_tensor")}
    taken = []
    for name in ("binary", "lut", "dequantize", "quantize"):
        monkeypatch.setattr(cuda_fused, name, lambda *a, _f=getattr(cuda_fused, name), _n=name: taken.append(_n) or _f(*a))
    kernels["add"](q, 0.1, 3, q, 0.1, 3, 0.2, 0, "none")
    kernels["mul"](q, 0.1, 3, q, 0.1, 3, 0.2, 0, "none")
    kernels["lut"](q, _codes((256,), 30).to(DEV))
    x = kernels["dequantize_per_tensor"](q, 0.1, 3)
    assert torch.equal(kernels["quantize_per_tensor"](x, 0.1, 3, 0, 255, torch.uint8), q)
    assert taken == ["binary", "binary", "lut", "dequantize", "quantize"]


@pytest.mark.parametrize("channels_last", [False, True])
def test_global_pooling_and_spatial_means_take_the_fused_kernel_with_the_fake_kernels_strides(channels_last, monkeypatch):
    from lucid_fx.kernels.library import KERNELS
    q = _codes((2, 6, 5, 4), 34)
    q = q.contiguous(memory_format=torch.channels_last) if channels_last else q
    taken = []
    monkeypatch.setattr(cuda_fused, "global_average",
                        lambda *a, _f=cuda_fused.global_average: taken.append(a) or _f(*a))
    pooled = KERNELS["adaptive_avg_pool2d"]["cuda"](q.to(DEV), 0.05, 10, [1, 1], 0.02, 7)
    expected = ref.adaptive_avg_pool2d(q, 0.05, 10, [1, 1], 0.02, 7)
    assert pooled.stride() == expected.stride()
    _codes_within_one(pooled, expected, exact=False)
    for dim, keepdim in (([2, 3], True), ([-1, -2], False)):
        mean = KERNELS["mean"]["cuda"](q.to(DEV), 0.05, 10, dim, keepdim, 0.02, 7)
        expected = ref.mean(q, 0.05, 10, dim, keepdim, 0.02, 7)
        assert mean.shape == expected.shape and mean.stride() == expected.stride()
        _codes_within_one(mean, expected, exact=False)
    assert len(taken) == 3
    KERNELS["mean"]["cuda"](q.to(DEV), 0.05, 10, [1], True, 0.02, 7)  # over channels: the torch ops
    KERNELS["adaptive_avg_pool2d"]["cuda"](q.to(DEV), 0.05, 10, [2, 2], 0.02, 7)
    assert len(taken) == 3


@pytest.mark.parametrize("shape,kernel,stride,padding,dilation", [
    ((2, 5, 7, 6), (3, 3), (1, 1), (1, 1), (1, 1)),
    ((1, 3, 9, 9), (3, 3), (2, 2), (1, 1), (1, 1)),  # K = 27: padded to 32
    ((2, 16, 5, 5), (1, 1), (1, 1), (0, 0), (1, 1)),
    ((1, 4, 8, 8), (3, 2), (1, 2), (2, 0), (2, 1)),
])
@pytest.mark.parametrize("dtype,channels_last", [(torch.uint8, False), (torch.uint8, True), (torch.int8, False)])
def test_the_gemm_operand_is_the_padded_shifted_im2col(shape, kernel, stride, padding, dilation, dtype, channels_last):
    q = _codes(shape, 31, dtype)
    q = q.contiguous(memory_format=torch.channels_last) if channels_last else q
    zp = 117 if dtype == torch.uint8 else -3
    cols, correction, (n, ho, wo) = cuda_fused.gemm_operand(q.to(DEV), zp, kernel, stride, padding, dilation)
    a, expected_correction = int_mm.as_int8(q, zp)
    expected, expected_shape = int_mm._im2col_nhwc(a, zp - 128 if dtype == torch.uint8 else zp, kernel, stride,
                                                   padding, dilation)
    m, k = expected.shape
    assert (n, ho, wo) == tuple(expected_shape) and correction == expected_correction
    assert cols.shape == (max(m, 17), -(-k // 8) * 8) and cols.dtype == torch.int8
    assert torch.equal(cols[:m, :k].cpu(), expected)
    assert not cols[m:].any() and not cols[:, k:].any(), "the padding is zeros"


def test_a_linear_s_operand_is_its_rows_shifted_and_padded():
    q = _codes((40, 24), 32)[:, 3:16]  # strided rows, K = 13
    cols, correction, _ = cuda_fused.gemm_operand(q.to(DEV), 100)
    assert cols.shape == (40, 16) and correction == 28
    assert torch.equal(cols[:, :13].cpu(), (q ^ 128).view(torch.int8)) and not cols[:, 13:].any()


@pytest.mark.parametrize("shape", [(2, 70, 7, 9), (1, 8, 1, 1), (3, 5, 12, 11)])
@pytest.mark.parametrize("dtype,channels_last", [(torch.uint8, False), (torch.uint8, True), (torch.int8, False)])
def test_global_average_is_adaptive_average_pooling_to_one_pixel(shape, dtype, channels_last):
    q = _codes(shape, 33, dtype)
    q = q.contiguous(memory_format=torch.channels_last) if channels_last else q
    zp = 120 if dtype == torch.uint8 else 4
    expected = ref.adaptive_avg_pool2d(q, 0.0413, zp, [1, 1], 0.0077, zp)
    out = cuda_fused.global_average(q.to(DEV), 0.0413, zp, 0.0077, zp)
    assert out.shape == expected.shape
    # the codes are summed exactly and rescaled once, where torch's mean sums rounded floats: a tie may move
    _codes_within_one(out, expected, exact=False)
    assert len(torch.unique(expected)) > min(10, expected.numel() // 3)


@pytest.mark.parametrize("off", ["operand", "dequantize"])
def test_one_fused_kernel_turned_off_leaves_the_others_and_the_same_codes(off, monkeypatch):
    qx = _act((1, 8, 9, 10), 35)
    qw = torch.randint(-127, 128, (8, 8 if off == "operand" else 1, 3, 3), dtype=torch.int8, generator=_gen(36))
    args = (qx.to(DEV), 0.03, 120, qw.to(DEV), torch.rand(8).to(DEV) * 0.01, None, [1, 1], [1, 1], [1, 1],
            1 if off == "operand" else 8, 0.08, 110, "relu", None)
    both_on = cuda._cuda_conv(*args)
    calls = []
    monkeypatch.setattr(cuda_fused, off if off == "dequantize" else "gemm_operand",
                        lambda *a, **k: calls.append(a) or pytest.fail(f"{off} is off"))
    monkeypatch.setattr(cuda_fused, "OFF", {off})
    _codes_within_one(cuda._cuda_conv(*args), both_on, exact=True)
    assert calls == [] and cuda_fused.available(qx.to(DEV), "epilogue")
