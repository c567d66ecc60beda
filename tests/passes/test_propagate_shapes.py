"""propagate_shapes: every tensor-valued node gets its shape and dtype; bad inputs name the node."""

import pytest
import torch
from torch import nn

import lucid_fx
from lucid_fx import _meta
from _bad_input import OptionalBias
from lucid_fx.passes.propagate_shapes import propagate_shapes
from lucid_fx.passes.trace_model import trace_model


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 4)

    def forward(self, x, ids):
        return torch.relu(self.fc(x)).flatten(1), ids.shape[0]


def test_shapes_and_dtypes_before_and_after():
    gm = trace_model(Net().eval()).graph_module
    assert not any(_meta.TENSOR_META in n.meta for n in gm.graph.nodes)
    out = propagate_shapes(gm, (torch.randn(2, 3, 6), torch.zeros(5, dtype=torch.long)))
    assert out is gm
    seen = {n.name: (tuple(n.meta[_meta.TENSOR_META].shape), n.meta[_meta.TENSOR_META].dtype)
            for n in gm.graph.nodes if hasattr(n.meta.get(_meta.TENSOR_META), "shape")}
    assert seen == {
        "x": ((2, 3, 6), torch.float32), "ids": ((5,), torch.int64), "fc": ((2, 3, 4), torch.float32),
        "relu": ((2, 3, 4), torch.float32), "flatten": ((2, 12), torch.float32),
    }
    assert str(gm.graph) == str(trace_model(Net().eval()).graph_module.graph)  # the graph itself is unchanged


def test_inputs_that_do_not_fit_name_the_node_and_the_shapes():
    gm = trace_model(Net().eval()).graph_module
    with pytest.raises(ValueError, match=r"(?s)fc.*Tensor\[2, 3, 5\]"):
        propagate_shapes(gm, (torch.randn(2, 3, 5), torch.zeros(5, dtype=torch.long)))


def test_a_parameter_left_at_its_default_none_is_named_with_concrete_args():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match=r"failed on inputs \(Tensor\[4, 8\] float32, None\) with TypeError: .*"
                                         r"forward's 'bias' took its default None, and torch.fx traced the code that uses "
                                         r"it: pass concrete_args=\{'bias': None\} to prepare"):
        lucid_fx.prepare(OptionalBias().eval(), example_inputs=(x,))
    prepared = lucid_fx.prepare(OptionalBias().eval(), example_inputs=(x,), concrete_args={"bias": None})  # as advised
    assert prepared(x).shape == (4, 8)
