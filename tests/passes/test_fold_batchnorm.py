"""fold_batchnorm: conv -> bn becomes one conv with the same output."""

import torch
from torch import nn

from lucid_fx import _meta
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


class SharedConv(nn.Module):
    """One conv module called twice: once before a batch norm, once without it."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn(self.conv(x)) + self.conv(x)


class ConvTwoNorms(nn.Module):
    """One conv module called twice, each call followed by its own batch norm."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn1, self.bn2 = nn.Conv2d(3, 4, 3, padding=1), nn.BatchNorm2d(4), nn.BatchNorm2d(4)

    def forward(self, x):
        return self.bn1(self.conv(x)) * self.bn2(self.conv(x))


def test_a_conv_called_elsewhere_is_folded_into_a_copy_for_that_call_only(registry):
    torch.manual_seed(2)
    model = SharedConv()
    _randomise(model.bn)
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    original = model.conv.weight.detach().clone()
    gm, before, after = _fold(model, x, registry)
    assert (before, after) == (["conv", "bn", "conv"], ["conv_folded_bn", "conv"])
    torch.testing.assert_close(gm.conv.weight, original, rtol=0, atol=0)  # the unfolded call is untouched
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_conv_with_a_batch_norm_at_each_call_gets_one_folded_copy_per_call(registry):
    torch.manual_seed(3)
    model = ConvTwoNorms()
    _randomise(model.bn1)
    _randomise(model.bn2)
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    gm, before, after = _fold(model, x, registry)
    # the first call gets a copy; the second is then the conv's only call and folds into it
    assert (before, after) == (["conv", "bn1", "conv", "bn2"], ["conv_folded_bn1", "conv"])
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_conv_whose_weight_is_read_in_the_graph_is_folded_into_a_copy(registry):
    class ReadsWeight(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn = nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4)

        def forward(self, x):
            return self.bn(self.conv(x)) * self.conv.weight.sum()

    torch.manual_seed(4)
    model = ReadsWeight()
    _randomise(model.bn)
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    gm, _, after = _fold(model, x, registry)
    assert after == ["conv_folded_bn"]
    torch.testing.assert_close(gm(x), model(x), atol=1e-5, rtol=1e-5)


def test_linear_bn1d_on_a_3d_value_is_not_folded_even_when_the_sizes_agree(registry):
    # BatchNorm1d on (N, C, L) normalises C (dim 1); the linear's outputs are L (dim -1). With
    # Linear(6, 4) on (N, 4, 6) the linear makes 6 features and the norm has 4: sizes disagree.
    # With Linear(4, 4) on (N, 4, 4) they agree, and only the rank tells the fold is wrong.
    for features, shape in ((6, (3, 4, 6)), (4, (3, 4, 4))):
        torch.manual_seed(5)
        model = nn.Sequential(nn.Linear(features, 4), nn.BatchNorm1d(4))
        _randomise(model[1])
        model.eval()
        x = torch.randn(*shape)
        gm, before, after = _fold(model, x, registry)
        assert before == after == ["0", "1"]
        bn = next(n for n in gm.graph.nodes if n.target == "1")
        assert bn.meta[_meta.BN_NOT_FOLDED] == (
            "batch norm not folded: it normalises dim 1 of _0's 3-D output, not the linear's output features; runs in float"
        )
        torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_a_channel_with_zero_running_variance_folds_to_finite_weights(registry):
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    _randomise(model[1])
    with torch.no_grad():
        model[1].running_var[2] = 0.0  # a dead channel: eps alone keeps 1/sqrt(var + eps) finite
    model.eval()
    x = torch.randn(2, 3, 6, 6)
    gm, _, after = _fold(model, x, registry)
    assert after == ["0"]
    assert torch.isfinite(gm.get_submodule("0").weight).all() and torch.isfinite(gm.get_submodule("0").bias).all()
    torch.testing.assert_close(gm(x), model(x), atol=1e-4, rtol=1e-5)
