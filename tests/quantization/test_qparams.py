import pytest
import torch

import lucid_fx.quantization as Q


def test_spec_example_minus2_to_6_quint8():
    scale, zp = Q.calculate_qparams(-2.0, 6.0, Q.per_tensor_affine, Q.quint8)
    assert scale.shape == () and zp.shape == ()
    assert scale.item() == pytest.approx(8 / 255)
    assert round(scale.item(), 4) == 0.0314
    assert zp.item() == 64


def test_spec_example_minus1_to_3():
    scale, zp = Q.calculate_qparams(-1.0, 3.0, Q.per_tensor_affine, Q.quint8)
    assert scale.item() == pytest.approx(4 / 255)
    assert zp.item() == 64


def test_zero_range_gives_eps_scale():
    scale, zp = Q.calculate_qparams(0.0, 0.0, Q.per_tensor_affine, Q.quint8)
    assert scale.item() == pytest.approx(1e-8) and scale.item() > 0
    assert zp.item() == 0


def test_range_is_widened_to_include_zero():
    # [2, 4] behaves as [0, 4]: zero stays exactly representable.
    scale, zp = Q.calculate_qparams(2.0, 4.0, Q.per_tensor_affine, Q.quint8)
    assert scale.item() == pytest.approx(4 / 255)
    assert zp.item() == 0


def test_symmetric_signed_and_unsigned():
    scale, zp = Q.calculate_qparams(-1.0, 3.0, Q.per_tensor_symmetric, Q.qint8)
    assert scale.item() == pytest.approx(3 / 127.5) and zp.item() == 0
    scale, zp = Q.calculate_qparams(-1.0, 3.0, Q.per_tensor_symmetric, Q.quint8)
    assert scale.item() == pytest.approx(3 / 127.5) and zp.item() == 128


def test_per_channel_shapes_follow_inputs():
    lo, hi = torch.tensor([-1.0, -4.0, 0.0]), torch.tensor([1.0, 2.0, 0.0])
    scale, zp = Q.calculate_qparams(lo, hi, Q.per_channel_symmetric, Q.qint8)
    assert scale.shape == (3,) and zp.shape == (3,)
    torch.testing.assert_close(scale, torch.tensor([1 / 127.5, 4 / 127.5, 1e-8]))
    assert zp.tolist() == [0, 0, 0]


def test_inverted_range_is_an_error():
    with pytest.raises(ValueError, match="must not exceed"):
        Q.calculate_qparams(1.0, -1.0)


@pytest.mark.parametrize(
    "lo, hi, qdtype, expected",
    [
        (0.0, 1.0, Q.quint8, (1 / 256, 0)),
        (0.0, 1.0, Q.qint8, (1 / 256, -128)),
        (-1.0, 1.0, Q.quint8, (2 / 256, 128)),
        (-1.0, 1.0, Q.qint8, (2 / 256, 0)),
        (0.0, 6.0, Q.quint8, (6 / 256, 0)),
        (0.0, 6.0, Q.qint8, (6 / 256, -128)),
        (-2.0, 2.0, Q.quint8, (4 / 256, 128)),
    ],
)
def test_fixed_qparams_table_of_spec_section_2(lo, hi, qdtype, expected):
    scale, zp = Q.fixed_qparams_for_interval(lo, hi, qdtype)
    assert scale == pytest.approx(expected[0]) and zp == expected[1]


def test_fixed_qparams_interval_excluding_zero_still_covers_it():
    scale, zp = Q.fixed_qparams_for_interval(2.0, 3.0, Q.quint8)
    assert zp == 0
    assert (Q.quint8.quant_max - zp) * scale >= 3.0 - scale


def test_named_fixed_defaults():
    obs = Q.default_fixed_qparams_range_0to1_observer()
    assert (obs.scale.item(), obs.zero_point.item()) == (1 / 256, 0)
    obs = Q.default_fixed_qparams_range_neg1to1_observer()
    assert (obs.scale.item(), obs.zero_point.item()) == (2 / 256, 128)
    fq = Q.default_fixed_qparams_range_neg1to1_fake_quant()
    assert (fq.scale.item(), fq.zero_point.item()) == (2 / 256, 128)


@pytest.mark.parametrize("qdtype", ["quint8", "qint8"])
def test_per_batch_qparams_are_calculate_qparams_in_python_numbers(qdtype):
    # Dynamic quantization's qparams of a batch: calculate_qparams's float32 steps, taken in Python numbers.
    from lucid_fx.quantization.dtypes import to_qdtype
    from lucid_fx.quantization.qparams import per_batch_qparams

    grid = to_qdtype(qdtype)
    g = torch.Generator().manual_seed(0)
    cases = [torch.zeros(3), torch.rand(5, generator=g), -torch.rand(5, generator=g), torch.tensor([1e-12, -3e-12])]
    cases += [torch.randn(9, generator=g) * 10.0 ** e + shift for e in range(-8, 5) for shift in (0.0, 0.7, -250.0)]
    for x in cases:
        lo, hi = torch.aminmax(x)
        scale, zero_point = Q.calculate_qparams(lo, hi, "per_tensor_affine", grid)
        assert per_batch_qparams(x, grid, "layer") == (float(scale), int(zero_point)), x
    with pytest.raises(ValueError, match="layer: the input holds inf or nan; a per-batch range needs finite values"):
        per_batch_qparams(torch.tensor([0.0, float("nan")]), grid, "layer")
