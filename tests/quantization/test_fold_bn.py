"""fold_bn_into: the folded layer computes bn(layer(x)), eps and all."""

import pytest
import torch
from torch import nn

from lucid_fx.quantization.fold_bn import fold_bn_into


def _randomised(bn: nn.modules.batchnorm._BatchNorm, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bn.running_mean.copy_(torch.randn(bn.num_features, generator=g))
        bn.running_var.copy_(torch.rand(bn.num_features, generator=g) * 1.5 + 0.5)
        if bn.affine:
            bn.weight.copy_(torch.randn(bn.num_features, generator=g))
            bn.bias.copy_(torch.randn(bn.num_features, generator=g))
    return bn.eval()


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("make", [
    lambda: (nn.Conv2d(3, 4, 3), nn.BatchNorm2d, (2, 3, 6, 6)),
    lambda: (nn.Conv1d(3, 4, 3, bias=False), nn.BatchNorm1d, (2, 3, 7)),
    lambda: (nn.Linear(6, 4), nn.BatchNorm1d, (5, 6)),
], ids=["conv2d", "conv1d-no-bias", "linear"])
def test_folded_layer_equals_the_pair(make, affine):
    torch.manual_seed(0)
    layer, norm, shape = make()
    bn = _randomised(norm(4, affine=affine), 1)
    x = torch.randn(*shape)
    folded = fold_bn_into(layer, bn)
    torch.testing.assert_close(folded(x), bn(layer(x)), atol=1e-5, rtol=1e-5)
    assert folded is not layer and folded.bias is not None  # a copy, with a bias even where the layer had none


def test_eps_is_part_of_the_fold():
    # A channel with zero running variance is scaled by 1/sqrt(eps): dropping eps gives inf there,
    # and a large eps changes every channel; both are visible in the folded weights themselves.
    layer = nn.Linear(3, 2)
    bn = _randomised(nn.BatchNorm1d(2, eps=0.25), 2)
    with torch.no_grad():
        bn.running_var[0] = 0.0
    folded = fold_bn_into(layer, bn)
    gamma = bn.weight.detach()
    expected = layer.weight.detach() * (gamma / torch.sqrt(bn.running_var + 0.25)).unsqueeze(1)
    torch.testing.assert_close(folded.weight.detach(), expected)
    assert torch.isfinite(folded.weight).all()
    x = torch.randn(4, 3)
    torch.testing.assert_close(folded(x), bn(layer(x)), atol=1e-5, rtol=1e-5)
