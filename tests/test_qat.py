"""QAT end to end: prepare_qat -> train -> convert, and what PTQ cannot do that QAT can."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.kernels import weight_quant_range
from lucid_fx.quantization import FakeQuantize, dequantize

parametrize = torch.nn.utils.parametrize
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "qat_recovers_accuracy.py"


def _example():
    spec = importlib.util.spec_from_file_location("qat_recovers_accuracy", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))


def _train(prepared, steps=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.SGD(prepared.parameters(), lr=0.05)
    for _ in range(steps):
        x = torch.randn(32, 8, generator=g)
        loss = F.cross_entropy(prepared(x), torch.randint(0, 3, (32,), generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return prepared


def _freeze(prepared):
    for module in prepared.modules():
        if isinstance(module, FakeQuantize):
            module.disable_observer()
    return prepared.eval()


def test_ptq_loses_accuracy_and_qat_recovers_it():
    figures = _example().main(quick=True)
    print(figures)
    assert figures["fp32"] > 0.95
    assert figures["ptq_int8"] < figures["fp32"] - 0.2  # the outlier column ruins per-channel weight scales
    assert figures["qat_fake_quant"] > figures["ptq_int8"] + 0.15
    assert abs(figures["qat_int8"] - figures["qat_fake_quant"]) < 0.01  # int8 computes what training saw


def test_every_weight_is_fake_quantized_on_the_kernel_grid_even_inside_fused_groups():
    prepared = lucid_fx.prepare_qat(_mlp(), example_inputs=(torch.randn(2, 8),))
    qmin, qmax = weight_quant_range("cpu")
    for name in ("0", "2"):  # "0" is fused with the relu after it
        layer = prepared.get_submodule(name)
        assert parametrize.is_parametrized(layer, "weight")
        fake_quant = layer.parametrizations.weight[0]
        assert isinstance(fake_quant, FakeQuantize) and (fake_quant.quant_min, fake_quant.quant_max) == (qmin, qmax)
        assert prepared.lucid_fx_weight_observers[name] is fake_quant
        codes = layer.weight / fake_quant.scale[:, None]  # what forward multiplies with lies on the grid
        assert torch.allclose(codes, codes.round(), atol=1e-4)
        assert qmin <= int(codes.round().min()) and int(codes.round().max()) <= qmax


def test_converted_weights_are_the_fake_quantized_weights_training_saw():
    prepared = _freeze(_train(lucid_fx.prepare_qat(_mlp(), example_inputs=(torch.randn(2, 8),))))
    seen = {name: prepared.get_submodule(name).weight.detach().clone() for name in ("0", "2")}
    qmodel = lucid_fx.convert(prepared)
    for name in ("0", "2"):
        codes, scales = getattr(qmodel, f"_lucid_{name}_qweight"), getattr(qmodel, f"_lucid_{name}_wscale")
        weight = dequantize(codes, scales, torch.zeros_like(scales, dtype=torch.int64), ch_axis=0)
        assert torch.allclose(weight, seen[name], atol=1e-6)
    x = torch.randn(64, 8)
    out, fake = qmodel(x), prepared(x)
    assert (out - fake).abs().max() <= 2 * float(prepared.lucid_fx_observers["_2"].scale)  # two output steps


def test_convert_leaves_the_qat_model_trainable_and_converts_twice():
    prepared = _train(lucid_fx.prepare_qat(_mlp(), example_inputs=(torch.randn(2, 8),)))
    x = torch.randn(4, 8)
    before = _freeze(prepared)(x).detach()
    first = lucid_fx.convert(prepared)
    # A deep copy of a parametrized module shares its class; un-parametrizing the copy used to
    # delete the original's weight property.
    assert parametrize.is_parametrized(prepared.get_submodule("0"), "weight")
    assert torch.equal(prepared(x).detach(), before)
    for module in prepared.modules():
        if isinstance(module, FakeQuantize):
            module.enable_observer()
    _train(prepared.train(), steps=2, seed=1)  # training continues after a convert
    assert not torch.equal(prepared(x).detach(), before)
    second = lucid_fx.convert(_freeze(prepared))
    assert first(x).shape == second(x).shape == (4, 3)
    assert not any(parametrize.is_parametrized(m) for m in list(first.modules()) + list(second.modules()))


def test_train_eval_toggle_and_frozen_observers():
    prepared = _train(lucid_fx.prepare_qat(_mlp(), example_inputs=(torch.randn(2, 8),)), steps=5)
    observer = prepared.lucid_fx_observers["_2"]
    _freeze(prepared)
    frozen = observer.scale.clone()
    prepared(100 * torch.randn(16, 8))  # far outside the trained range
    assert torch.equal(observer.scale, frozen)
    prepared.train()
    observer.enable_observer()
    prepared(100 * torch.randn(16, 8))
    assert float(observer.scale) > float(frozen)


def test_convert_of_a_qat_model_that_never_ran_names_the_nodes():
    prepared = lucid_fx.prepare_qat(_mlp(), example_inputs=(torch.randn(2, 8),))
    with pytest.raises(ValueError, match=r"^convert: the observers of node\(s\) input_1, _1, _2 saw no data; run lucid_fx\.calibrate"):
        lucid_fx.convert(prepared)


def test_qat_conv_batchnorm_folds_at_convert(sqnr_db):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 6 * 6, 4))
    prepared = lucid_fx.prepare_qat(model, example_inputs=(torch.randn(2, 3, 8, 8),))
    opt = torch.optim.SGD(prepared.parameters(), lr=0.01)
    for step in range(10):
        x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(step))
        loss = prepared(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    _freeze(prepared)
    qmodel = lucid_fx.convert(prepared)
    assert "batch_norm" not in str(qmodel.graph) and "conv2d" in qmodel.code
    x = torch.randn(8, 3, 8, 8)
    assert sqnr_db(prepared(x), qmodel(x)) > 20  # folded weights are re-observed, not given stale qparams
