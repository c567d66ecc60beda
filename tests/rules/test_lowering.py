"""Lowering rules: which int8 kernel a canonical op becomes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx


class Pool1d(nn.Module):
    def __init__(self, functional: bool):
        super().__init__()
        self.conv = nn.Conv1d(2, 4, 3)
        self.pool = nn.MaxPool1d(3, stride=2, padding=1)
        self.functional = functional

    def forward(self, x):
        y = self.conv(x)
        return F.max_pool1d(y, 2) if self.functional else self.pool(y)


@pytest.mark.parametrize("functional", [False, True], ids=["module", "function"])
def test_max_pool1d_runs_on_codes(functional):
    # Regression (found by tests/test_fuzz.py): max_pool1d ran torch's own op on uint8 codes,
    # which has no uint8 kernel ("max_pool1d_impl" not implemented for 'Byte').
    torch.manual_seed(0)
    model = Pool1d(functional).eval()
    batches = [torch.randn(2, 2, 11) for _ in range(3)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    kernels = [n.target.__name__ for n in qmodel.graph.nodes if n.op == "call_function"]
    assert kernels == ["quantize_per_tensor", "conv1d", "max_pool2d", "dequantize_per_tensor"]
    x = batches[1]
    out, ref = qmodel(x), lucid_fx.convert(prepared, reference=True)(x)
    assert out.shape == model(x).shape == (2, 4, 4 if functional else 5)
    # Max-pooling codes is exact: outputs stay on the conv's output grid, one step from the reference.
    scale, zp = (v.item() for v in prepared.lucid_fx_observers["conv"].calculate_qparams())
    codes = out / scale + zp
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    assert (out - ref).abs().max() <= scale + 1e-6


def test_functional_max_pool2d_uses_the_int16_kernel():
    # F.max_pool2d passes dilation/ceil_mode/return_indices by keyword; the rule used to decline
    # any keyword beyond the first three and run torch's slow uint8 max-pool instead.
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x):
            return F.max_pool2d(self.conv(x), 2, ceil_mode=True)

    torch.manual_seed(0)
    model = Net().eval()
    batches = [torch.randn(1, 3, 9, 9) for _ in range(2)]
    prepared = lucid_fx.prepare(model, example_inputs=(batches[0],))
    lucid_fx.calibrate(prepared, batches, progress=False)
    qmodel = lucid_fx.convert(prepared)
    pools = [n.target for n in qmodel.graph.nodes if "max_pool" in str(n.target)]
    assert pools == [torch.ops.lucid_fx.max_pool2d]
    out, ref = qmodel(batches[1]), lucid_fx.convert(prepared, reference=True)(batches[1])
    assert out.shape == (1, 4, 4, 4)  # ceil_mode kept: 7 -> 4
    scale = prepared.lucid_fx_observers["conv"].calculate_qparams()[0].item()
    assert (out - ref).abs().max() <= scale + 1e-6
