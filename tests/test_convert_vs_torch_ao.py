"""Differential test against torch.ao's convert_fx (an oracle in tests only): same models, same
calibration data, both lowered to int8 on this CPU. The two differ by design in the grid they
give up a bit on (torch.ao: 7-bit activations; lucid_fx: 7-bit weights on CPUs without VNNI)
and in kernels, so they are compared to each other within a stated tolerance, and each to fp32.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx


class ConvNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8, 5)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.conv2(y) + y)  # residual add
        return self.fc(y.mean((2, 3)))


class LinearNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        h = F.relu(self.fc1(x))
        return self.fc3(F.relu(self.fc2(h)) + h)  # add of two quantized branches


def _torch_ao(model, example, batches):
    from torch.ao.quantization import get_default_qconfig_mapping
    from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.backends.quantized.engine = "x86"
        prepared = prepare_fx(copy.deepcopy(model), get_default_qconfig_mapping("x86"), (example,))
        with torch.no_grad():
            for b in batches:
                prepared(b)
        return convert_fx(prepared)


def _sqnr(ref, out):
    return float(10 * torch.log10(ref.pow(2).mean() / (ref - out).pow(2).mean()))


@pytest.mark.parametrize(
    "make, shape, agree_db, fp32_db",
    [(ConvNet, (4, 3, 12, 12), 25.0, 28.0), (LinearNet, (16, 32), 28.0, 30.0)],
    ids=["conv_bn_relu_add", "linear_add"],
)
def test_outputs_agree_with_torch_ao(make, shape, agree_db, fp32_db):
    torch.manual_seed(0)
    model = make().eval()
    batches = [torch.randn(shape) for _ in range(8)]
    ours = lucid_fx.quantize(model, (batches[0],), batches)
    theirs = _torch_ao(model, batches[0], batches)
    x = torch.randn(shape)
    with torch.no_grad():
        fp32, a, b = model(x), ours(x), theirs(x)
    agreement, ours_db, theirs_db = _sqnr(b, a), _sqnr(fp32, a), _sqnr(fp32, b)
    print(f"lucid_fx vs torch.ao {agreement:.1f} dB; vs fp32: lucid_fx {ours_db:.1f}, torch.ao {theirs_db:.1f}")
    assert agreement > agree_db
    assert ours_db > fp32_db
    assert ours_db > theirs_db - 1.0  # never meaningfully less accurate than the peer
