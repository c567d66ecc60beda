"""lucid_fx/kernels/onednn_steps.py: which float steps oneDNN's int8 linear takes for a shape, asked of it. A fake
oneDNN of each kind runs on every machine; the real one on this machine's kind."""

import pytest
import torch

from lucid_fx.kernels import cpu, onednn_steps
from lucid_fx.kernels.codes import f32_reciprocal
from lucid_fx.kernels.cpu_features import detected_cpu_features

pytestmark = pytest.mark.skipif(not cpu.onednn_available(), reason="this torch build has no oneDNN quantized ops")


def _fake_onednn(monkeypatch, steps):
    """oneDNN as ``steps`` computes: the exact sums, then the float steps and the codes' rounding."""
    weights = {}

    def pack(qw):
        weights[id(qw)] = qw
        return qw

    def linear(qx, x_scale, qw, ws, zeros, bias, out_scale, out_zp, dtype):
        acc = (qx.double() @ qw.double().t()).float()
        xs = torch.tensor(x_scale, dtype=torch.float32)
        y = steps(acc, xs, ws) + bias
        if dtype == torch.float32:
            return y
        inv = torch.tensor(f32_reciprocal(out_scale), dtype=torch.float32)
        return y.mul(inv).add_(out_zp).clamp_(0, 255).round_().to(torch.uint8)
    monkeypatch.setattr(onednn_steps, "_onednn_pack", pack)
    monkeypatch.setattr(onednn_steps, "_onednn_linear", linear)
    onednn_steps.linear_steps.cache_clear()


@pytest.mark.parametrize("name, steps", [
    ("vnni", lambda acc, xs, ws: acc * xs * ws),
    ("amx", lambda acc, xs, ws: acc * (xs * ws)),
    (None, lambda acc, xs, ws: (acc.double() * xs.double() * ws.double()).float()),  # neither: one rounding
])
@pytest.mark.parametrize("m, n, k", [(1, 256, 1024), (4, 64, 256), (1, 2, 2)])
def test_the_probe_names_the_steps_oneDNN_took(name, steps, m, n, k, monkeypatch):
    _fake_onednn(monkeypatch, steps)
    try:
        assert onednn_steps.linear_steps(m, n, k, 2) == name
    finally:
        onednn_steps.linear_steps.cache_clear()


@pytest.mark.parametrize("tail", [0, 1, 16])
def test_a_probe_of_many_rows_checks_its_last_rows_too(tail, monkeypatch):
    # 200 rows, the first and last 16 checked (CHECKED_ROWS): a oneDNN whose last `tail` rows take the other steps
    # (a tail kernel) is neither kind; with none, the AMX kind
    def steps(acc, xs, ws):
        y = acc * (xs * ws)
        if tail:
            y[-tail:] = acc[-tail:] * xs * ws
        return y
    _fake_onednn(monkeypatch, steps)
    try:
        assert onednn_steps.linear_steps(200, 64, 256, 2) == (None if tail else "amx")
    finally:
        onednn_steps.linear_steps.cache_clear()


def test_the_probe_of_this_machine_s_onednn_matches_its_kind():
    found = {shape: onednn_steps.linear_steps(*shape, torch.get_num_threads()) for shape in [(1, 256, 1024), (4, 64, 64)]}
    kind = detected_cpu_features()
    if kind.amx:  # both kinds of kernel, chosen by shape: each probe decided
        assert set(found.values()) <= {"vnni", "amx"} and None not in found.values(), found
    elif kind.vnni:  # its VNNI kernels, whatever the shape
        assert set(found.values()) == {"vnni"}, found
    else:  # AVX2: its kernels multiply the scales first, where full-grid weights do not saturate its int16 pair sums
        assert "vnni" not in found.values(), found


def test_the_convolution_probe_of_this_machine_s_onednn_matches_its_kind():
    depthwise = ((1, 64, 14, 14), (64, 1, 3, 3), (1, 1), (1, 1), (1, 1), 64)
    found = {post: onednn_steps.conv_steps(*depthwise, post, torch.get_num_threads()) for post in ("none", "hardswish")}
    assert onednn_steps.conv_steps(*depthwise, "tanh", torch.get_num_threads()) is None  # a post-op it does not check
    kind = detected_cpu_features()
    if kind.amx:
        assert None not in found.values(), found
    elif kind.vnni:
        assert set(found.values()) == {"vnni"}, found
    else:
        assert "vnni" not in found.values(), found
