"""functionalize_inplace: in-place ops become out-of-place ones where nothing else sees the change."""

import torch
import torch.nn.functional as F
from torch import nn

from lucid_fx import _meta
from lucid_fx.passes.functionalize_inplace import functionalize_inplace
from lucid_fx.passes.trace_model import trace_model


class Mutating(nn.Module):
    """Each step changes ``h`` in place and ignores the result; the next step reads ``h``."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        h = self.fc(x)
        h.mul_(2)
        torch.relu_(h)
        h.add_(1)
        self.relu(h)
        F.relu(h, inplace=True)
        h.clamp_(0, 0.5)
        h.sigmoid_()
        return h


def _graph(gm):
    return [(n.op, n.target if isinstance(n.target, str) else n.target.__name__, [a.name for a in n.all_input_nodes])
            for n in gm.graph.nodes]


def test_in_place_ops_become_a_chain_of_out_of_place_ones(registry):
    torch.manual_seed(0)
    model = Mutating().eval()
    gm = trace_model(model).graph_module
    assert [n for n in gm.graph.nodes if n.op != "placeholder"][-1].args[0].name == "fc"  # before: returns fc's node
    functionalize_inplace(gm, registry)
    assert _graph(gm) == [
        ("placeholder", "x", []),
        ("call_module", "fc", ["x"]),
        ("call_method", "mul", ["fc"]),
        ("call_function", "relu", ["mul_"]),
        ("call_method", "add", ["relu_"]),
        ("call_module", "relu", ["add_"]),
        ("call_function", "relu", ["relu"]),
        ("call_method", "clamp", ["relu_1"]),
        ("call_method", "sigmoid", ["clamp_"]),
        ("output", "output", ["sigmoid_"]),
    ]
    assert gm.relu.inplace is False and model.relu.inplace is False  # trace_model works on the model it is given
    assert [n.kwargs for n in gm.graph.nodes if n.target is F.relu] == [{"inplace": False}]
    assert not any(_meta.MUTATION in n.meta for n in gm.graph.nodes)
    x = torch.randn(4, 8)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_a_change_the_caller_sees_stays_in_place_and_is_read_after(registry):
    class OnInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            x.mul_(2)
            return self.fc(x)

    model = OnInput().eval()
    gm = functionalize_inplace(trace_model(model).graph_module, registry)
    mul, fc = [n for n in gm.graph.nodes if n.op in ("call_method", "call_module")]
    assert (mul.target, fc.args[0]) == ("mul_", mul)  # still in place; fc reads its result
    assert mul.meta[_meta.MUTATION] == "changes model input 'x' in place, which the caller sees"
    x = torch.randn(3, 8)
    expected_x, expected = x.clone(), model(x.clone())
    out = gm(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    torch.testing.assert_close(x, expected_x * 2, rtol=0, atol=0)  # the caller's tensor changed, as in float


def test_a_view_whose_base_is_read_later_keeps_the_op_in_place_and_rereads_the_base(registry):
    class ViewMutation(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            h = self.fc(x)
            h[:, :4].sigmoid_()
            return self.fc2(h)

    torch.manual_seed(0)
    model = ViewMutation().eval()
    gm = functionalize_inplace(trace_model(model).graph_module, registry)
    assert _graph(gm) == [
        ("placeholder", "x", []),
        ("call_module", "fc", ["x"]),
        ("call_function", "getitem", ["fc"]),
        ("call_method", "sigmoid_", ["getitem"]),
        ("call_method", "view_as", ["fc"]),
        ("call_module", "fc2", ["view_as"]),
        ("output", "output", ["fc2"]),
    ]
    why = {n.name: n.meta.get(_meta.MUTATION) for n in gm.graph.nodes}
    assert why["sigmoid_"] == "changes 'getitem' in place, and 'fc' shares its storage and is read afterwards"
    assert why["getitem"].startswith("shares storage with the value 'sigmoid_' changes in place")
    assert why["view_as"] == "reads 'fc' after 'sigmoid_' changed it in place"
    assert why["fc"] is None and why["fc2"] is None  # the base itself may still be int8
    x = torch.randn(3, 8)
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0)


def test_values_read_before_the_change_and_shape_reads_do_not_block_it(registry):
    class Before(nn.Module):
        def forward(self, x):
            h = x * 3
            n = h.size(0)
            early = h + 1  # a new tensor, computed before the change
            h.sigmoid_()
            return h.reshape(n, -1), early

    model = Before().eval()
    gm = functionalize_inplace(trace_model(model).graph_module, registry)
    assert [n.target for n in gm.graph.nodes if n.op == "call_method"] == ["size", "sigmoid", "reshape"]
    x = torch.randn(2, 4)
    for got, want in zip(gm(x), model(x)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_a_shared_in_place_module_stays_in_place_when_one_call_cannot_drop_it(registry):
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.relu = nn.ReLU(inplace=True)

        def forward(self, x):
            a = self.relu(x * 2)  # nothing else sees this change
            self.relu(x)  # the caller does see this one
            return a + x

    model = Shared().eval()
    gm = functionalize_inplace(trace_model(model).graph_module, registry)
    calls = [n for n in gm.graph.nodes if n.op == "call_module"]
    assert gm.relu.inplace is True
    assert _meta.MUTATION not in calls[0].meta and "model input 'x'" in calls[1].meta[_meta.MUTATION]
    x = torch.randn(5)
    expected = model(x.clone())
    torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)
