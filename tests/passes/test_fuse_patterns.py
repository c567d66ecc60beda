"""fuse_patterns: groups are marked; only their last node is observed."""

import torch
import torch.nn.functional as F
from torch import nn

from lucid_fx import _meta
from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.fuse_patterns import fuse_patterns
from lucid_fx.passes.trace_model import trace_model


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)) + x)
        return F.relu(self.fc(y.mean((2, 3))))


def test_groups_are_marked(registry):
    gm = trace_model(Residual().eval()).graph_module
    fuse_patterns(canonicalize_ops(gm, registry), registry)
    marks = {n.name: (n.meta.get(_meta.FUSION), n.meta.get(_meta.FUSED_INTO)) for n in gm.graph.nodes}
    assert marks["conv1"] == marks["bn1"] == marks["relu"] == ("conv_bn_relu", "relu")
    assert marks["conv2"] == marks["bn2"] == marks["add"] == marks["relu_1"] == ("conv_bn_add_relu", "relu_1")
    assert marks["fc"] == marks["relu_2"] == ("linear_relu", "relu_2")
    assert marks["mean"] == (None, None)


def test_a_value_that_escapes_is_not_fused(registry):
    class Escapes(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)

        def forward(self, x):
            y = self.fc(x)
            return torch.relu(y), y  # fc's raw output is needed too

    gm = trace_model(Escapes()).graph_module
    fuse_patterns(canonicalize_ops(gm, registry), registry)
    assert all(_meta.FUSION not in n.meta for n in gm.graph.nodes)


def test_training_batchnorm_is_not_folded_into_a_group(registry):
    gm = trace_model(Residual().train()).graph_module
    fuse_patterns(canonicalize_ops(gm, registry), registry)
    assert gm.graph.find_nodes(op="call_module", target="bn1")[0].meta.get(_meta.FUSION) is None
