"""lucid_fx::masked_softmax: the reference, CPU and dispatched kernels against the float oracle."""

import pytest
import torch

import lucid_fx.quantization as Q
from lucid_fx.kernels import attention, cpu_float

ops = torch.ops.lucid_fx
NEG_INF = float("-inf")


def _scores(shape=(2, 3, 8, 8), seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g), 0.05, 131


def _kernels():
    return (attention.masked_softmax, cpu_float.masked_softmax, ops.masked_softmax)


def _oracle(q, scale, zp, mask, fill):
    s = Q.dequantize(q, scale, zp)
    s = s.masked_fill(mask, fill) if fill is not None else s + mask
    return Q.quantize(torch.softmax(s, -1).nan_to_num(nan=0.0), 1 / 256, 0, "quint8")


def _close(out, expected):
    # the CPU kernel may round a tie one step the other way (as lucid_fx.softmax does)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    assert int((out.int() - expected.int()).abs().max()) <= 1
    assert float((out != expected).float().mean()) < 0.01


MASKS = {
    "bool -inf": (torch.rand(2, 1, 1, 8, generator=torch.Generator().manual_seed(1)) < 0.4, NEG_INF),
    "bool -1e9": (torch.ones(8, 8, dtype=torch.bool).triu(1), -1e9),
    "additive finfo.min": (torch.ones(8, 8).triu(1) * torch.finfo(torch.float32).min, None),
    "additive bias": (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2)), None),
    "additive grows": (torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(3)).triu(1) * -1e4, None),
}


@pytest.mark.parametrize("name", MASKS)
def test_every_kernel_matches_the_float_oracle(name):
    mask, fill = MASKS[name]
    q, scale, zp = _scores((2, 1, 8, 8) if name == "additive grows" else (2, 3, 8, 8))
    expected = _oracle(q, scale, zp, mask, fill)
    for kernel in _kernels():
        out = kernel(q, scale, zp, mask, fill, -1, 1 / 256, 0)
        _close(out, expected)
        if name != "additive bias":
            masked = (mask if fill is not None else mask < -1e3).expand(out.shape)
            assert torch.equal(out[masked], torch.zeros_like(out[masked]))  # exactly zero, not one code


@pytest.mark.parametrize("fill,row", [(NEG_INF, 0), (-1e9, 32), (torch.finfo(torch.float32).min, 32)])
def test_a_fully_masked_row_is_zero_for_minus_inf_and_uniform_for_a_finite_fill(fill, row):
    q, scale, zp = _scores((1, 1, 2, 8))
    mask = torch.tensor([[True] * 8, [False] * 7 + [True]])  # row 0 masks every key
    for kernel in _kernels():
        out = kernel(q, scale, zp, mask, fill, -1, 1 / 256, 0)
        assert out[0, 0, 0].tolist() == [row] * 8  # 1/8 = 32/256; float gives NaN for -inf
        assert out[0, 0, 1, 7] == 0 and out[0, 0, 1].sum() > 240


def test_the_dim_and_int8_codes_are_honoured():
    q = torch.randint(-128, 128, (3, 6, 5), dtype=torch.int8, generator=torch.Generator().manual_seed(4))
    mask = torch.zeros(3, 6, 5, dtype=torch.bool)
    mask[:, 2] = True
    mask[0, :, 0] = True  # fully masked along dim 1: NaN in float, and a NaN cast to int8 would be code 0 (p = 0.5)
    y = torch.softmax(Q.dequantize(q, 0.1, -3).masked_fill(mask, NEG_INF), 1).nan_to_num(nan=0.0)
    expected = Q.quantize(y, 1 / 256, -128, "qint8")
    for kernel in _kernels():
        out = kernel(q, 0.1, -3, mask, NEG_INF, 1, 1 / 256, -128)
        _close(out, expected)
        assert (out[:, 2] == -128).all() and (out[0, :, 0] == -128).all()


def test_a_fill_value_needs_a_bool_mask():
    q, scale, zp = _scores()
    for kernel in _kernels():
        with pytest.raises(ValueError, match="must be torch.bool"):
            kernel(q, scale, zp, torch.zeros(8, 8), NEG_INF, -1, 1 / 256, 0)
