"""Helpers shared by the two halves of the bad-input matrix (test_bad_input*.py) and the passes' tests of awkward inputs."""

import torch
from torch import nn

import lucid_fx

_ops = torch.ops.lucid_fx


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3)).eval()


def _batches(n=4, shape=(8, 4), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _calibrated(model, example, batches):
    prepared = lucid_fx.prepare(model, example_inputs=(example,))
    lucid_fx.calibrate(prepared, batches, progress=False)
    return prepared


def _targets(qmodel):
    return [getattr(n.target, "__name__", str(n.target)) for n in qmodel.graph.nodes if n.op == "call_function"]


class OptionalBias(nn.Module):
    """A forward with a parameter whose default, None, skips a branch (``if bias is not None``)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, bias=None):
        h = self.fc(x)
        if bias is not None:
            h = h + bias
        return h
