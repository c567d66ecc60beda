import torch

import lucid_fx.quantization as Q


def test_fake_quantize_observes_then_quantizes():
    fq = Q.FakeQuantize(averaging_constant=1.0)
    x = torch.tensor([-1.0, 0.0, 0.3, 3.0], requires_grad=True)
    y = fq(x)
    scale, zp = Q.calculate_qparams(-1.0, 3.0)
    torch.testing.assert_close(y.detach(), Q.fake_quantize(x.detach(), scale, zp, 0, 255))
    y.sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0, 1.0]


def test_toggles_return_self_and_take_effect():
    fq = Q.FakeQuantize()
    assert fq.disable_fake_quant() is fq and fq.disable_observer() is fq
    x = torch.tensor([0.0, 0.123456, 1.0])
    assert torch.equal(fq(x), x)
    assert not Q.FakeQuantize().disable_observer().activation_post_process.has_data
    fq.enable_observer().enable_fake_quant()
    assert not torch.equal(fq(x), x)
    assert fq.activation_post_process.has_data


def test_per_channel_fake_quantize_module():
    fq = Q.FakeQuantize(observer=Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0)
    w = torch.tensor([[1.0, -0.5], [0.1, 0.05]])
    y = fq(w)
    scale, zp = fq.calculate_qparams()
    assert scale.shape == (2,)
    torch.testing.assert_close(y, Q.fake_quantize(w, scale, zp, -128, 127, ch_axis=0))


def test_fixed_qparams_fake_quant_never_observes():
    fq = Q.FixedQParamsFakeQuantize(Q.FixedQParamsObserver.with_args(scale=1 / 256, zero_point=0))
    fq(torch.tensor([5.0, -5.0]))
    assert fq.scale.item() == 1 / 256 and fq.zero_point.item() == 0
    torch.testing.assert_close(fq(torch.tensor([0.5, 2.0, -1.0])), torch.tensor([0.5, 255 / 256, 0.0]))


def test_fixed_qparams_fake_quant_rejects_statistics_observer():
    import pytest

    with pytest.raises(ValueError, match="needs a FixedQParamsObserver factory, got MinMaxObserver"):
        Q.FixedQParamsFakeQuantize(Q.MinMaxObserver)
