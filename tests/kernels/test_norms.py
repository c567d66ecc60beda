"""lucid_fx::layer_norm and rms_norm: int8 codes in and out, float statistics inside. Their SQNR
against the float op on a typical input, and the CPU kernels (no dequantize) against the
reference ones."""

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
