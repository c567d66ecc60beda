"""restore_modules: an exported graph's functional layers on their own parameters become module
calls again, sharing the tensors; anything else is left as it is."""

import torch
import torch.nn.functional as F
from torch import fx, nn

from lucid_fx.passes.export_model import export_model


def _calls(gm):
    return [(n.op, n.target if n.op == "call_module" else getattr(n.target, "__name__", n.target))
            for n in gm.graph.nodes if n.op in ("call_module", "call_function")]


def test_conv_batch_norm_and_linear_become_modules_sharing_the_parameters():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, stride=2, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                          nn.Linear(64, 5)).eval()
    model[1].running_mean.uniform_(-1, 1)
    x = torch.randn(2, 3, 8, 8)
    gm = export_model(model, (x,))
    assert _calls(gm) == [("call_module", "0"), ("call_module", "1"), ("call_function", "relu"),
                          ("call_function", "flatten"), ("call_module", "4")]
    assert type(gm.get_submodule("0")) is nn.Conv2d and gm.get_submodule("0").stride == (2, 2)
    assert type(gm.get_submodule("1")) is nn.BatchNorm2d and type(gm.get_submodule("4")) is nn.Linear
    assert torch.equal(gm.get_submodule("1").running_mean, model[1].running_mean)
    assert not any(n.op == "get_attr" for n in gm.graph.nodes)
    torch.testing.assert_close(gm(x), model(x))


class SharedWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x):
        return F.linear(x, self.w) + self.w.sum()  # the weight is also read elsewhere: stays functional


def test_a_parameter_read_elsewhere_keeps_the_functional_call():
    gm = export_model(SharedWeight().eval(), (torch.randn(2, 4),))
    assert ("call_function", "linear") in _calls(gm)
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
