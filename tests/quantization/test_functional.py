import pytest
import torch

import lucid_fx.quantization as Q


def test_spec_quantize_examples():
    assert Q.quantize(torch.tensor([100.0]), 0.05, 0, Q.qint8).tolist() == [127]
    q = Q.quantize(torch.tensor([-1000.0, 1000.0]), 0.05, 0, Q.qint8)
    assert q.tolist() == [-128, 127] and q.dtype == torch.int8
    assert Q.quantize(torch.tensor([0.5]), 0.1, 3, Q.quint8).dtype == torch.uint8


def test_dequantize_is_float32_affine():
    q = torch.tensor([0, 64, 255], dtype=torch.uint8)
    x = Q.dequantize(q, 8 / 255, 64)
    assert x.dtype == torch.float32
    torch.testing.assert_close(x, torch.tensor([-64 * 8 / 255, 0.0, 191 * 8 / 255]))


def test_per_channel_round_trip_within_half_step():
    torch.manual_seed(0)
    w = torch.randn(5, 7, 3)
    lo, hi = w.transpose(0, 1).reshape(7, -1).aminmax(dim=1)
    scale, zp = Q.calculate_qparams(lo, hi, Q.per_channel_symmetric, Q.qint8)
    q = Q.quantize(w, scale, zp, Q.qint8, ch_axis=1)
    back = Q.dequantize(q, scale, zp, ch_axis=1)
    assert q.dtype == torch.int8
    err = (back - w).abs()
    assert (err <= scale.reshape(1, 7, 1) / 2 + 1e-6).all(), (err / scale.reshape(1, 7, 1)).max()


def test_fake_quantize_spec_gradient():
    x = torch.tensor([0.5, 99.0], requires_grad=True)
    y = Q.fake_quantize(x, 0.1, 0, 0, 255)
    y.sum().backward()
    assert x.grad.tolist() == [1.0, 0.0]
    torch.testing.assert_close(y.detach(), torch.tensor([0.5, 25.5]))


def test_fake_quantize_equals_quantize_then_dequantize():
    torch.manual_seed(1)
    x = torch.randn(64) * 3
    fq = Q.fake_quantize(x, 0.02, 10, -128, 127)
    torch.testing.assert_close(fq, Q.dequantize(Q.quantize(x, 0.02, 10, Q.qint8), 0.02, 10))


def test_per_channel_param_count_mismatch_is_explained():
    with pytest.raises(ValueError, match="per-channel qparams have 3 values but axis 0 of the input has 4"):
        Q.quantize(torch.zeros(4, 2), torch.ones(3), torch.zeros(3), Q.qint8, ch_axis=0)
    with pytest.raises(ValueError, match="pass ch_axis"):
        Q.quantize(torch.zeros(4, 2), torch.ones(4), torch.zeros(4), Q.qint8)
