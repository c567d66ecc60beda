"""fold_batchnorm: conv -> bn becomes one conv with the same output."""

import torch
from torch import nn

from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.fold_batchnorm import fold_batchnorm
from lucid_fx.passes.propagate_shapes import propagate_shapes
from lucid_fx.passes.trace_model import trace_model


def _randomise(bn):
    with torch.no_grad():  # non-trivial statistics
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2)
        bn.weight.uniform_(0.5, 1.5)
        bn.bias.uniform_(-0.5, 0.5)


def _fold(model, x, registry):
    gm = canonicalize_ops(propagate_shapes(trace_model(model).graph_module, (x,)), registry)
    before = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    fold_batchnorm(gm)
    return gm, before, [n.target for n in gm.graph.nodes if n.op == "call_module"]


def test_conv_bn_folds_and_matches(registry):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.BatchNorm2d(5), nn.ReLU(), nn.Flatten(2), nn.Linear(36, 4), nn.BatchNorm1d(5))
    _randomise(model[1])
    _randomise(model[5])
    model.eval()
    x = torch.randn(2, 3, 8, 8)
    gm, before, after = _fold(model, x, registry)
    assert before == ["0", "1", "2", "3", "4", "5"]
    # conv+bn folds; linear -> bn1d does not: bn normalises dim 1 (5), the linear makes dim -1 (4)
    assert after == ["0", "2", "3", "4", "5"]
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
    assert not hasattr(gm, "1")


def test_linear_bn_folds_in_2d(registry):
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    _randomise(model[1])
    model.eval()
    x = torch.randn(3, 6)
    gm, before, after = _fold(model, x, registry)
    assert (before, after) == (["0", "1"], ["0"])
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)
