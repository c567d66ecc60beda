"""equalize: cross-layer equalization finds the conv/linear pairs a model runs, leaves the float
function as it was, and makes the MobileNetV2-like model quantize far better."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx.transforms import ChannelClip

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `tests.models` under a bare `pytest` too
from tests.models.measure_transforms import Setup  # noqa: E402
from tests.models.families import FAMILIES  # noqa: E402


def _separable(relu6: bool = False) -> nn.Sequential:
    """1x1 conv -> BN -> ReLU(6) -> depthwise 3x3 -> BN -> ReLU(6) -> 1x1 conv, with the depthwise
    channels' ranges spread over three decades (a folded MobileNetV2 block)."""
    torch.manual_seed(0)
    act = nn.ReLU6 if relu6 else nn.ReLU
    model = nn.Sequential(nn.Conv2d(4, 8, 1), nn.BatchNorm2d(8), act(), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                          nn.BatchNorm2d(8), act(), nn.Conv2d(8, 6, 1)).eval()
    with torch.no_grad():
        model[3].weight.mul_(torch.logspace(-2, 1, 8).reshape(8, 1, 1, 1))
        for bn in (model[1], model[4]):
            bn.running_mean.uniform_(-0.1, 0.1)
            bn.running_var.uniform_(0.5, 2)
    return model


def _ranges(conv: nn.Conv2d) -> torch.Tensor:
    return conv.weight.detach().abs().flatten(1).amax(1)


def test_depthwise_separable_pairs_are_equalized_and_the_function_kept():
    model, x = _separable(), torch.randn(2, 4, 9, 9)
    equalized = lucid_fx.equalize(model, (x,))
    report = equalized.lucid_fx_transforms[-1]
    assert report.transform == "equalize" and report.skipped == []
    assert [line.split(":")[0] for line in report.changed] == ["0 -> 3 (batch norm folded, relu)", "3 -> 6 (batch norm folded, relu)"]
    assert report.float_sqnr_db > 100
    torch.testing.assert_close(equalized(x), model(x), rtol=1e-4, atol=1e-5)
    # the depthwise conv's per-channel ranges were 1000x apart; equalized, within 10x
    before, after = _ranges(model[3]), _ranges(equalized[3])
    assert float(before.max() / before.min()) > 500 and float(after.max() / after.min()) < 10
    assert isinstance(equalized[1], nn.Identity) and isinstance(equalized[4], nn.Identity)  # folded


def test_the_model_is_copied_unless_inplace():
    model, x = _separable(), torch.randn(2, 4, 9, 9)
    weight = model[3].weight.detach().clone()
    equalized = lucid_fx.equalize(model, (x,))
    assert equalized is not model and torch.equal(model[3].weight, weight)
    assert not hasattr(model, "lucid_fx_transforms")
    same = lucid_fx.equalize(model, (x,), inplace=True)
    assert same is model and not torch.equal(model[3].weight, weight)


def test_relu6_modes():
    model, x = _separable(relu6=True), torch.randn(2, 4, 9, 9) * 4
    relu = lucid_fx.equalize(model, (x,), relu6="relu")
    assert type(relu[2]) is nn.ReLU and "relu6 -> relu" in relu.lucid_fx_transforms[-1].changed[0]
    clip = lucid_fx.equalize(model, (x,), relu6="clip")
    assert isinstance(clip[2], ChannelClip) and isinstance(clip[5], ChannelClip)
    torch.testing.assert_close(clip(x), model(x), rtol=1e-4, atol=1e-5)  # exact even where values pass 6
    keep = lucid_fx.equalize(model, (x,), relu6="keep")
    assert keep.lucid_fx_transforms[-1].changed == []
    assert keep.lucid_fx_transforms[-1].skipped == ["0 -> 3: joined by a ReLU6 (relu6='keep')", "3 -> 6: joined by a ReLU6 (relu6='keep')"]


class _FunctionalRelu6(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 8, 1), nn.Conv2d(8, 4, 1)

    def forward(self, x):
        return self.b(F.relu6(self.a(x)))


def test_a_relu6_function_call_is_skipped_with_the_reason():
    report = lucid_fx.equalize(_FunctionalRelu6().eval(), (torch.randn(1, 3, 4, 4),)).lucid_fx_transforms[-1]
    assert report.changed == []
    assert report.skipped == ["a -> b: joined by a ReLU6 (the ReLU6 is a function call, not a module that can be replaced)"]


class _Residual(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = torch.relu(self.a(x))
        return self.c(torch.relu(self.b(y)) + y)  # y is read twice: a's channels cannot move into b alone


def test_a_value_read_twice_is_not_rescaled():
    model, x = _Residual().eval(), torch.randn(1, 4, 5, 5)
    equalized = lucid_fx.equalize(model, (x,))
    assert equalized.lucid_fx_transforms[-1].changed == []
    assert torch.equal(equalized.a.weight, model.a.weight) and torch.equal(equalized.b.weight, model.b.weight)


def test_bad_arguments_name_what_is_wrong():
    model = _separable()
    with pytest.raises(ValueError, match=r"equalize: relu6 must be one of \('relu', 'clip', 'keep'\), got 'none'"):
        lucid_fx.equalize(model, (torch.randn(1, 4, 5, 5),), relu6="none")
    model[4].train()
    with pytest.raises(ValueError, match=r"equalize: module '4' \(BatchNorm2d\) is in training mode; call model.eval\(\) first"):
        lucid_fx.equalize(model, (torch.randn(1, 4, 5, 5),))


@pytest.fixture(scope="module")
def mobilenet():
    return Setup(FAMILIES["mobilenet_v2"])


def test_mobilenet_v2_gains_at_least_6_db(mobilenet):
    # measured: 5.3 dB plain, 19.1 dB equalized (+13.7), 36 pairs, float output 115 dB from the original
    equalized = lucid_fx.equalize(mobilenet.model, mobilenet.example)
    report = equalized.lucid_fx_transforms[-1]
    assert len(report.changed) == 36 and report.float_sqnr_db > 90
    plain, after = mobilenet.int8_sqnr(mobilenet.model), mobilenet.int8_sqnr(equalized)
    assert plain < 8 and after > 16 and after - plain > 10, (plain, after)
