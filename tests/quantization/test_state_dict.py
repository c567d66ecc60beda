"""Every observer round-trips through state_dict into a fresh instance and gives the same qparams."""

import pytest
import torch

import lucid_fx.quantization as Q

OBSERVERS = [
    Q.MinMaxObserver.with_args(),
    Q.MinMaxObserver.with_args(qscheme=Q.per_tensor_symmetric, qdtype=Q.qint8),
    Q.MovingAverageMinMaxObserver.with_args(averaging_constant=0.2),
    Q.PerChannelMinMaxObserver.with_args(ch_axis=1),
    Q.MovingAveragePerChannelMinMaxObserver.with_args(),
    Q.HistogramObserver.with_args(bins=512),
    Q.FixedQParamsObserver.with_args(scale=2 / 256, zero_point=128),
    Q.FakeQuantize.with_args(),
    Q.FakeQuantize.with_args(observer=Q.MovingAveragePerChannelMinMaxObserver, ch_axis=0),
]


@pytest.mark.parametrize("make", OBSERVERS, ids=repr)
def test_round_trip_into_fresh_instance(make):
    torch.manual_seed(0)
    trained = make()
    for _ in range(3):
        trained(torch.randn(6, 5, 4) * 3)
    fresh = make()
    result = fresh.load_state_dict(trained.state_dict())
    assert result.missing_keys == [] and result.unexpected_keys == []
    for a, b in zip(trained.calculate_qparams(), fresh.calculate_qparams()):
        assert torch.equal(a, b)
    for key, value in trained.state_dict().items():
        assert torch.equal(value, fresh.state_dict()[key]), key


def test_per_channel_buffers_that_changed_shape_load():
    trained = Q.PerChannelMinMaxObserver()
    trained(torch.randn(7, 3))
    fresh = Q.PerChannelMinMaxObserver()
    assert fresh.min_val.shape == (0,)
    fresh.load_state_dict(trained.state_dict())
    assert fresh.min_val.shape == (7,)
    # and a second load with another channel count replaces the first
    other = Q.PerChannelMinMaxObserver()
    other(torch.randn(2, 3))
    fresh.load_state_dict(other.state_dict())
    assert fresh.min_val.shape == (2,)
    torch.testing.assert_close(fresh.calculate_qparams(), other.calculate_qparams())


def test_histogram_with_other_bin_count_loads():
    trained = Q.HistogramObserver(bins=64)
    trained(torch.randn(100))
    fresh = Q.HistogramObserver()
    fresh.load_state_dict(trained.state_dict())
    assert fresh.bins == 64
    torch.testing.assert_close(fresh.calculate_qparams(), trained.calculate_qparams())
