"""correct_bias: the int8 model's output mean moves back to the float model's."""

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx.quantization import get_default_qconfig_mapping


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(8, 16, 3, bias=False), nn.ReLU(), nn.Conv2d(16, 8, 1)).eval()


def _batches(n: int):
    g = torch.Generator().manual_seed(1)
    return [torch.rand(4, 8, 10, 10, generator=g) + 1 for _ in range(n)]  # inputs with a mean far from 0


def _mean_error(model: nn.Module, reference: nn.Module, batches, held_out) -> float:
    """Worst channel of the int8 model's output mean minus the float model's, on held-out data."""
    qmodel = lucid_fx.quantize(model, (held_out[0],), batches)
    with torch.no_grad():
        diff = torch.cat([qmodel(x) - reference(x) for x in held_out])
    return float(diff.mean((0, 2, 3)).abs().max())


def test_the_mean_shift_of_int8_weights_is_removed():
    model, batches, held_out = _model(), _batches(6), _batches(9)[6:]
    corrected = lucid_fx.correct_bias(model, batches)
    report = corrected.lucid_fx_transforms[-1]
    assert [line.split(":")[0] for line in report.changed] == ["0", "2"]
    assert corrected[0].bias is not None and model[0].bias is None  # a bias added, on the copy only
    assert 20 < report.float_sqnr_db < 80  # the float model moves, by design
    before, after = _mean_error(model, model, batches, held_out), _mean_error(corrected, model, batches, held_out)
    assert after < before / 2, (before, after)


class _WithUnused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body, self.unused = _model(), nn.Linear(3, 3)

    def forward(self, x):
        return self.body(x)


def test_a_float_layer_and_an_unused_layer_are_left_alone():
    model = _WithUnused().eval()
    mapping = get_default_qconfig_mapping().set_module_name("body.2", None)
    corrected = lucid_fx.correct_bias(model, _batches(2), mapping)
    report = corrected.lucid_fx_transforms[-1]
    assert [line.split(":")[0] for line in report.changed] == ["body.0"]
    assert report.skipped == ["unused: never called on the calibration data"]
    assert torch.equal(corrected.body[2].bias, model.body[2].bias)


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="correct_bias: the calibration data was empty"):
        lucid_fx.correct_bias(_model(), [])
    with pytest.raises(ValueError, match=r"correct_bias: the model \(Sequential\) is in training mode"):
        lucid_fx.correct_bias(_model().train(), _batches(1))
