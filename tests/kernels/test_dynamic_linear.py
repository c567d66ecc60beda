"""lucid_fx/kernels/dynamic_linear.py: the one native call against the pieces it replaces (per-batch qparams in
Python, the native quantize and GEMM) and against the torch route, on four builds; exact integer arithmetic for
reference; inf and NaN refused."""

import pytest
import torch

from lucid_fx.kernels import dynamic_linear as dl
from lucid_fx.kernels import native
from lucid_fx.kernels.recurrent import recurrent_weight
from lucid_fx.quantization.dtypes import qint8, quint8
from lucid_fx.quantization.qparams import per_batch_qparams


def _weight(n: int, k: int, seed: int, bias: bool = True):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(-63, 64, (n, k), generator=g, dtype=torch.int8)  # every build's grid (no VNNI: int16 pairs)
    return codes, torch.rand(n, generator=g) * 0.02 + 0.005, torch.randn(n, generator=g) if bias else None


def _inputs(m: int, k: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g) * (1 + seed % 3) + (seed % 5 - 2) * 0.7  # zero points all over the grid


def _exact(x, codes, scale, bias):
    """float64 of the product from x's codes on its own grid and exact integer sums."""
    s, zp = per_batch_qparams(x, quint8, "x")
    q = torch.clamp(torch.round(x * torch.tensor(1 / s, dtype=torch.float32)) + zp, 0, 255).long() - zp
    out = (q @ codes.long().T).double() * s * scale.double()
    return out if bias is None else out + bias.double()


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "no AVX-512", "portable"])
def test_the_one_call_is_the_pieces_bit_for_bit_and_the_exact_product(native_build, monkeypatch, build):
    native_build(build)
    for m, k, n, seed in [(1, 64, 48, 0), (1, 33, 17, 1), (5, 256, 96, 2), (12, 100, 64, 3), (3, 64, 40, 4),
                          (2, 64, 40, 5), (7, 128, 8, 6), (1, 8, 8, 7)]:
        codes, scale, bias = _weight(n, k, seed, bias=seed % 4 != 3)
        weight, x = recurrent_weight(codes, scale, bias), _inputs(m, k, seed)
        one = dl.one_call(x, weight, quint8, "x")
        assert one is not None and one.shape == (m, n)
        with monkeypatch.context() as patch:
            patch.setattr(dl, "one_call", lambda *args: None)
            pieces = dl.dynamic_linear(x, weight, quint8, "x")
            patch.setattr(dl, "small_gemm", lambda *args: False)  # torch.ops.lucid_fx.quantize_per_tensor and linear
            torch_route = dl.dynamic_linear(x, weight, quint8, "x")
        assert torch.equal(one, pieces), (m, k, n, seed)
        # oneDNN's float steps round in another order (up to 2.3e-5 apart at these sizes); both are the exact
        # product within float32's rounding
        exact = _exact(x, codes, scale, bias)
        for got in (one, torch_route):
            torch.testing.assert_close(got.double(), exact, rtol=2e-6, atol=2e-5)


def test_dynamic_linear_takes_the_one_call_where_it_can(native_on, monkeypatch):
    codes, scale, bias = _weight(32, 64, 0)
    weight, x = recurrent_weight(codes, scale, bias), _inputs(4, 64, 0)
    calls = []
    one_call = dl.one_call
    monkeypatch.setattr(dl, "one_call", lambda *args: calls.append(args[0].shape) or one_call(*args))
    dl.dynamic_linear(x, weight, quint8, "x")
    dl.dynamic_linear(x, weight, qint8, "x")  # int8 activations: the torch route, no call
    assert calls == [(4, 64)]


def test_the_one_call_declines_what_it_does_not_take(native_on):
    codes, scale, bias = _weight(16, 32, 1)
    weight, x = recurrent_weight(codes, scale, bias), _inputs(6, 32, 1)
    assert dl.one_call(x.double(), weight, quint8, "x") is None  # not float32
    assert dl.one_call(x.t().contiguous().t(), weight, quint8, "x") is None  # not dense rows
    # dynamic_linear runs those on its other routes, with the same values
    assert torch.equal(dl.dynamic_linear(x.t().contiguous().t(), weight, quint8, "x"), dl.dynamic_linear(x, weight, quint8, "x"))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_inf_or_nan_is_refused_naming_the_layer(native_or_torch, bad):
    codes, scale, bias = _weight(16, 32, 2)
    x = _inputs(3, 32, 2)
    x[2, 5] = bad
    with pytest.raises(ValueError, match=r"^DynamicQuantizedLinear: the input holds inf or nan; a per-batch range needs "
                                         r"finite values$"):
        dl.dynamic_linear(x, recurrent_weight(codes, scale, bias), quint8, "DynamicQuantizedLinear")
    assert native_or_torch == "torch" or native.available()
