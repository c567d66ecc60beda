"""analyze_ranges: bounded ops and composites are proven; unbounded ones are not."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.passes.analyze_ranges import analyze_ranges
from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.trace_model import trace_model


class Composites(nn.Module):
    def forward(self, x, y):
        a = (torch.tanh(x) + 1) / 2
        b = 1 - torch.sigmoid(x)
        c = F.relu6(x) / 6
        d = torch.cat([torch.sigmoid(x), torch.tanh(y)], dim=1).flatten(1)
        e = torch.relu(torch.tanh(x))
        f = torch.minimum(torch.sigmoid(x), torch.tanh(y))
        g = x * 2 + 1  # unbounded
        h = torch.sigmoid(x) / torch.tanh(y)  # divisor spans 0: unbounded
        i = torch.clamp(x, min=0)  # one-sided: unbounded
        return a, b, c, d, e, f, g, h, i


@pytest.fixture
def ranges(registry):
    gm = trace_model(Composites()).graph_module
    analyze_ranges(canonicalize_ops(gm, registry), registry)
    return {n.name: n.meta.get(_meta.INTERVAL) for n in gm.graph.nodes}


def test_composites_are_proven(ranges):
    assert ranges["truediv"] == (0.0, 1.0)  # (tanh(x) + 1) / 2
    assert ranges["add"] == (0.0, 2.0)
    assert ranges["sub"] == (0.0, 1.0)  # 1 - sigmoid(x)
    assert ranges["relu6"] == (0.0, 6.0) and ranges["truediv_1"] == (0.0, 1.0)  # relu6(x) / 6
    assert ranges["cat"] == (-1.0, 1.0) and ranges["flatten"] == (-1.0, 1.0)
    assert ranges["relu"] == (0.0, 1.0)
    assert ranges["minimum"] == (-1.0, 1.0)


def test_unbounded_stay_unproven(ranges):
    assert ranges["x"] is None and ranges["mul"] is None and ranges["add_1"] is None
    assert ranges["truediv_2"] is None
    assert ranges["clamp"] is None


def my_gate(x):
    return torch.sigmoid(x) * torch.sigmoid(2 * x)


def test_user_bounded_op_is_proven_and_composes(registry):
    lucid_fx.register_bounded_op(my_gate, (0.0, 1.0))

    class Gated(nn.Module):
        def forward(self, x):
            return my_gate(x) * 4 - 2

    gm = trace_model(Gated(), autowrap_functions=registry.leaf_functions).graph_module
    analyze_ranges(canonicalize_ops(gm, registry), registry)
    found = {n.name: n.meta.get(_meta.INTERVAL) for n in gm.graph.nodes}
    assert found["my_gate"] == (0.0, 1.0)
    assert found["sub"] == (-2.0, 2.0)


def test_a_squashing_op_of_a_bounded_input_is_proven_in_its_image(registry):
    class Nested(nn.Module):
        def forward(self, x):
            return torch.tanh(torch.sigmoid(x)), torch.sigmoid(torch.tanh(x)), F.softsign(torch.tanh(x))

    gm = trace_model(Nested()).graph_module
    analyze_ranges(canonicalize_ops(gm, registry), registry)
    found = {n.name: n.meta.get(_meta.INTERVAL) for n in gm.graph.nodes}
    assert found["tanh"] == pytest.approx((0.0, math.tanh(1.0)))  # tanh of [0, 1]
    assert found["sigmoid_1"] == pytest.approx((1 / (1 + math.e), 1 / (1 + math.exp(-1))))  # sigmoid of [-1, 1]
    assert found["softsign"] == pytest.approx((-0.5, 0.5))  # softsign of [-1, 1]
