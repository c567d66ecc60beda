"""lucid_fx::layer_norm and rms_norm: int8 codes in and out, float statistics inside. Their SQNR
against the float op on a typical input, and the CPU kernels (no dequantize) against the
reference ones."""

import unittest.mock

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.kernels import norms
from lucid_fx.quantization import default_qconfig, get_default_qconfig_mapping as default_qconfig_mapping

ops = torch.ops.lucid_fx


def _sqnr(ref, out):
    return (10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean())).item()


def _grid(t):
    lo, hi = min(t.min().item(), 0.0), max(t.max().item(), 0.0)
    scale = (hi - lo) / 255
    return scale, int(round(-lo / scale))


def _typical():
    """Rows of different means and spreads, as a residual stream's (no outlier features: min/max grids)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 32, 128, generator=g) * (torch.rand(8, 32, 1, generator=g) + 0.5) + torch.randn(8, 32, 1, generator=g)
    w, b = torch.rand(128, generator=g) + 0.5, torch.randn(128, generator=g) * 0.1
    return x, w, b


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_sqnr_against_float(op):
    x, w, b = _typical()
    scale, zp = _grid(x)
    q = ops.quantize_per_tensor(x, scale, zp, 0, 255, torch.uint8)
    ref = F.layer_norm(x, [128], w, b, 1e-5) if op == "layer_norm" else F.rms_norm(x, [128], w, 1e-6)
    out_scale, out_zp = _grid(ref)
    if op == "layer_norm":
        codes = ops.layer_norm(q, scale, zp, [128], w, b, 1e-5, out_scale, out_zp)
    else:
        codes = ops.rms_norm(q, scale, zp, [128], w, 1e-6, out_scale, out_zp)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert _sqnr(ref, ops.dequantize_per_tensor(codes, out_scale, out_zp)) >= 30


@pytest.mark.parametrize("zp", [0, 37, 128])
def test_cpu_kernels_match_the_reference(zp):
    x, w, b = _typical()
    q = ops.quantize_per_tensor(x, 0.05, zp, 0, 255, torch.uint8)
    for fast, slow, args in (
        (norms.cpu_layer_norm, norms.layer_norm, ([128], w, b, 1e-5)),
        (norms.cpu_rms_norm, norms.rms_norm, ([128], w, 1e-6)),
    ):
        steps = (fast(q, 0.05, zp, *args, 0.03, 128).int() - slow(q, 0.05, zp, *args, 0.03, 128).int()).abs()
        assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01  # ties only


def test_fake_kernel_gives_the_shape():
    q = torch.empty(2, 3, 8, dtype=torch.uint8, device="meta")
    assert ops.layer_norm(q, 0.1, 0, [8], None, None, 1e-5, 0.1, 0).shape == (2, 3, 8)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.ln, self.down, self.rms = nn.Linear(32, 128), nn.LayerNorm(128), nn.Linear(128, 32), nn.RMSNorm(32)

    def forward(self, x):
        return self.rms(self.down(self.ln(self.up(x))))


def _converted(model, x, qconfig_mapping=None):
    prepared = lucid_fx.prepare(model, qconfig_mapping, example_inputs=(x,))
    for seed in range(4):
        prepared(torch.randn(4, 16, 32, generator=torch.Generator().manual_seed(seed)))
    return lucid_fx.convert(prepared)


def test_a_qconfig_for_the_norms_converts_them_to_int8():
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(4, 16, 32)
    mapping = default_qconfig_mapping().set_object_type("layer_norm", default_qconfig).set_object_type(nn.RMSNorm, default_qconfig)
    converted = _converted(model, x, mapping)
    targets = [n.target for n in converted.graph.nodes if n.op == "call_function"]
    assert ops.layer_norm in targets and ops.rms_norm in targets
    assert converted.lucid_fx_convert_report.float_ops == {}
    assert _sqnr(model(x), converted(x)) >= 30


def test_norms_run_in_float_by_default_and_say_why():
    torch.manual_seed(0)
    model, x = Block().eval(), torch.randn(4, 16, 32)
    converted, forced = _converted(model, x), _converted(model, x, default_qconfig_mapping()
                                                         .set_object_type("layer_norm", default_qconfig)
                                                         .set_object_type("rms_norm", default_qconfig))
    targets = [n.target for n in converted.graph.nodes if n.op == "call_function"]
    assert ops.layer_norm not in targets and ops.rms_norm not in targets
    assert [t for t in targets if t in (ops.linear, ops.quantize_per_tensor)] == [ops.quantize_per_tensor, ops.linear] * 2
    floats = converted.lucid_fx_convert_report.float_ops
    assert sorted(floats) == ["ln", "rms"]
    assert all("runs in float where it pays" in why for why in floats.values())
    assert "layer_norm runs in float where it pays" in str(converted.lucid_fx_convert_report)
    assert _sqnr(model(x), converted(x)) > _sqnr(model(x), forced(x))


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "portable"])
def test_the_native_pass_gives_the_torch_path_s_codes(native_build, build):
    # native_norm.c: exact sums of the codes, then float32 steps; 8 codes a step with AVX2, tails and
    # builds without it one at a time. Against the torch path (F.layer_norm / F.rms_norm of the codes).
    native_build(build)
    from lucid_fx.kernels import native

    calls, function = [], native._function
    assert function("norm", torch.uint8) is not None and function("norm", torch.int8) is not None
    g = torch.Generator().manual_seed(3)
    for dtype, zp in ((torch.uint8, 131), (torch.int8, -3)):
        info = torch.iinfo(dtype)
        for shape, normalized in (((2, 16, 16, 16), [16]), ((4, 7, 33), [7, 33]), ((5, 13), [13]), ((3, 1000), [1000])):
            q = torch.randint(info.min, info.max + 1, shape, dtype=dtype, generator=g)
            q[0] = info.max  # a constant row: variance 0, rstd = 1 / sqrt(eps)
            w, b = torch.randn(normalized, generator=g), torch.randn(normalized, generator=g)
            for kernel, args in ((norms.cpu_layer_norm, (w, b)), (norms.cpu_layer_norm, (None, None)),
                                 (norms.cpu_rms_norm, (w,)), (norms.cpu_rms_norm, (None,))):
                with unittest.mock.patch.object(native, "_function", lambda *a: calls.append(a) or function(*a)):
                    got = kernel(q, 0.02, zp, normalized, *args, 1e-5, 0.03, 5)
                with unittest.mock.patch.object(native, "_function", lambda *a: None):
                    want = kernel(q, 0.02, zp, normalized, *args, 1e-5, 0.03, 5)
                steps = (got.int() - want.int()).abs()
                assert got.dtype == dtype and steps.max() <= 1 and (steps > 0).float().mean() < 0.005
    assert len(calls) == 32 and all(call[0] == "norm" for call in calls)


def test_rows_past_the_exact_int32_sums_take_the_torch_path():
    # 65025 * n must stay below 2^31: rows of 2^15 codes or more are left to torch.
    q = torch.full((1, 1 << 15), 255, dtype=torch.uint8)
    assert norms._native_norm(q, 0, [1 << 15], None, None, 1e-5, 0.1, 0, rms=True) is None
    y = norms.cpu_rms_norm(q, 0.02, 0, [1 << 15], None, 1e-5, 0.1, 0)
    assert y.shape == q.shape and int(y.min()) == int(y.max()) == 10  # (255 / 255) / 0.1


# ---- group norm: codes in the input's layout, a channel's map one affine step ----


def _conv_like(shape=(2, 32, 12, 10), seed=0):
    """Channels of different means and spreads, as a convolution's output."""
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    x = torch.randn(shape, generator=g) * (torch.rand(1, c, *[1] * (len(shape) - 2), generator=g) * 2 + 0.2)
    return x + torch.randn(1, c, *[1] * (len(shape) - 2), generator=g), torch.rand(c, generator=g) + 0.5, torch.randn(c, generator=g) * 0.2


@pytest.mark.parametrize("channels_last", [False, True])
def test_group_norm_sqnr_against_float_in_the_input_s_layout(channels_last):
    x, w, b = _conv_like()
    scale, zp = _grid(x)
    q = ops.quantize_per_tensor(x, scale, zp, 0, 255, torch.uint8)
    q = q.contiguous(memory_format=torch.channels_last) if channels_last else q
    ref = F.group_norm(x, 8, w, b, 1e-5)
    out_scale, out_zp = _grid(ref)
    codes = ops.group_norm(q, scale, zp, 8, w, b, 1e-5, out_scale, out_zp)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and codes.stride() == q.stride()
    assert _sqnr(ref, ops.dequantize_per_tensor(codes, out_scale, out_zp)) >= 30


@pytest.mark.parametrize("build", ["this CPU", "no AVX-512", "portable"])
def test_group_norm_s_native_passes_give_the_reference_codes(native_build, build):
    # native_norm.c: exact sums per channel, then x * a[k] + b[k] per code; against the reference
    # kernel (dequantize -> F.group_norm -> quantize) and the torch path of cpu_group_norm.
    native_build(build)
    from lucid_fx.kernels import native

    calls, function = [], native._function
    g = torch.Generator().manual_seed(5)
    for dtype, zp in ((torch.uint8, 131), (torch.int8, -3)):
        info = torch.iinfo(dtype)
        for shape, groups in (((2, 16, 7, 9), 4), ((3, 12, 33), 3), ((5, 6), 2), ((1, 8, 200, 200), 8)):
            q = torch.randint(info.min, info.max + 1, shape, dtype=dtype, generator=g)
            q[0, : shape[1] // groups] = info.max  # a constant group: variance 0, its values the bias
            w, b = torch.randn(shape[1], generator=g), torch.randn(shape[1], generator=g)
            layouts = (q, q.contiguous(memory_format=torch.channels_last)) if q.dim() == 4 else (q,)
            for codes in layouts:
                for args in ((w, b), (None, None), (w, None)):
                    with unittest.mock.patch.object(native, "_function", lambda *a: calls.append(a) or function(*a)):
                        got = norms.cpu_group_norm(codes, 0.02, zp, groups, *args, 1e-5, 0.03, 5)
                    with unittest.mock.patch.object(native, "_function", lambda *a: None):
                        torch_path = norms.cpu_group_norm(codes, 0.02, zp, groups, *args, 1e-5, 0.03, 5)
                    want = norms.group_norm(codes, 0.02, zp, groups, *args, 1e-5, 0.03, 5)
                    bias = torch.zeros(shape[1]) if args[1] is None else args[1]
                    constant = (bias[: shape[1] // groups] / 0.03).round().add(5).clamp(info.min, info.max).to(dtype)
                    assert torch.equal(got[0, : shape[1] // groups].reshape(shape[1] // groups, -1), constant[:, None].expand(-1, q[0, 0].numel()))
                    # torch's channels-last group norm takes its variance from float32 sums: on 40,000 equal
                    # values it is not 0 (rstd off by 10x), so the constant group is compared above only
                    got, torch_path, want = got[:, shape[1] // groups:], torch_path[:, shape[1] // groups:], want[:, shape[1] // groups:]
                    for other in (torch_path, want):
                        steps = (got.int() - other.int()).abs()
                        assert got.dtype == dtype and got.stride() == other.stride()
                        assert steps.max() <= 1 and (steps > 0).float().mean() < 0.005
    assert len(calls) == 2 * 6 * 3 and all(call[0] == "group_norm" for call in calls)  # dtypes x layouts x args


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8])
def test_group_norm_s_tail_is_the_lookup_after_it(dtype):
    # The program hands a following lut (a SiLU's table) or a dequantize's float table to the norm.
    g = torch.Generator().manual_seed(2)
    info = torch.iinfo(dtype)
    q = torch.randint(info.min, info.max + 1, (2, 16, 9, 9), dtype=dtype, generator=g).contiguous(memory_format=torch.channels_last)
    w, b = torch.randn(16, generator=g), torch.randn(16, generator=g)
    codes = norms.cpu_group_norm(q, 0.02, 0, 4, w, b, 1e-5, 0.03, 0)
    for tail in (torch.randint(info.min, info.max + 1, (256,), dtype=dtype, generator=g), torch.randn(256, generator=g)):
        got = norms.cpu_group_norm(q, 0.02, 0, 4, w, b, 1e-5, 0.03, 0, tail)
        want = ops.lut(codes, tail)
        assert torch.equal(got, want) and got.dtype == tail.dtype and got.stride() == q.stride()
