"""canonicalize_ops: every spelling becomes one canonical op with its constants."""

import operator

import torch
import torch.nn.functional as F
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.trace_model import trace_model


class Spellings(nn.Module):
    def __init__(self):
        super().__init__()
        self.sig, self.sm, self.tanh, self.hs, self.r6, self.ht = (
            nn.Sigmoid(), nn.Softmax(dim=1), nn.Tanh(), nn.Hardsigmoid(), nn.ReLU6(), nn.Hardtanh(-2.0, 3.0)
        )

    def forward(self, x):
        return (
            self.sig(x), torch.sigmoid(x), F.sigmoid(x), x.sigmoid(), x.clone().sigmoid_(), torch.special.expit(x),
            self.sm(x), F.softmax(x, dim=1), torch.softmax(x, 1), x.softmax(-1),
            self.tanh(x), torch.tanh(x), x.tanh(), F.tanh(x),
            self.hs(x), F.hardsigmoid(x),
            self.r6(x), F.relu6(x), self.ht(x), F.hardtanh(x, -0.5, 0.5), torch.clamp(x, 0, 2), x.clip(-1, 1),
            x + 1, x.view(2, -1), x.permute(1, 0),
        )


def _calls(gm):
    return [n.meta[_meta.OP] for n in gm.graph.nodes if n.op not in ("placeholder", "output")]


def test_every_spelling_maps_to_one_canonical_op(registry):
    gm = trace_model(Spellings()).graph_module
    before = [n.op for n in gm.graph.nodes]
    canonicalize_ops(gm, registry)
    assert [n.op for n in gm.graph.nodes] == before  # annotation only; the graph is unchanged
    ops = [c.op for c in _calls(gm) if c.op != "clone"]
    assert ops == (
        ["sigmoid"] * 6 + ["softmax"] * 4 + ["tanh"] * 4 + ["hardsigmoid"] * 2 + ["clamp"] * 6 + ["add", "reshape", "permute"]
    )


def test_constants_are_normalised(registry):
    gm = canonicalize_ops(trace_model(Spellings()).graph_module, registry)
    calls = {n.name: n.meta[_meta.OP] for n in gm.graph.nodes}
    assert calls["sm"].args["dim"] == 1 and calls["softmax_2"].args["dim"] == -1
    assert (calls["r6"].args["min"], calls["r6"].args["max"]) == (0.0, 6.0)
    assert (calls["relu6"].args["min"], calls["relu6"].args["max"]) == (0.0, 6.0)
    assert (calls["ht"].args["min"], calls["ht"].args["max"]) == (-2.0, 3.0)
    assert (calls["hardtanh"].args["min"], calls["hardtanh"].args["max"]) == (-0.5, 0.5)
    assert calls["view"].args["shape"] == (2, -1)
    assert calls["sigmoid_"].inplace and not calls["sigmoid_1"].inplace
    assert calls["sig"].spelling == "nn.Sigmoid" and calls["softmax"].spelling == "F.softmax"


def test_unknown_ops_keep_their_own_name_unless_a_rule_knows_it(registry):
    # a call no spelling knows keeps its own name; where that is an op's name, qualified, so no rule takes it for
    # that op (a leaf module at ``self.linear`` is no nn.Linear, a function called ``softmax`` no softmax)
    def custom(x):
        return x

    def softmax(x):
        return x

    class Leaf(nn.Module):
        def forward(self, x):
            return x

    root = nn.Module()
    root.linear, root.leaf = Leaf(), Leaf()
    graph = fx.Graph()
    x = graph.placeholder("x")
    calls = [graph.call_function(custom, (x,)), graph.call_function(softmax, (x,)), graph.call_module("linear", (x,)),
             graph.call_module("leaf", (x,)), graph.call_method("linear", (x,)), graph.call_function(operator.pow, (x, 2))]
    graph.output(tuple(calls))
    gm = canonicalize_ops(fx.GraphModule(root, graph), registry)
    assert [n.meta[_meta.OP].op for n in gm.graph.nodes][1:-1] == [
        "custom", f"{__name__}.softmax", "Leaf:linear", "leaf", "Tensor.linear", "pow"]  # x ** 2: a spelling of pow


def test_node_meta_names_other_nodes_so_a_deep_copy_reads_its_own(registry):
    import copy

    from lucid_fx.ops import NodeRef, canonical

    class Cat(nn.Module):
        def forward(self, x, y):
            return torch.cat([x.sigmoid(), y], 1) + x

    gm = canonicalize_ops(trace_model(Cat()).graph_module, registry)
    stored = {n.name: n.meta[_meta.OP] for n in gm.graph.nodes}
    assert stored["cat"].args["tensors"] == [NodeRef("sigmoid"), NodeRef("y")]
    assert stored["add"].args == {"input": NodeRef("cat"), "other": NodeRef("x")}
    no_nodes = lambda v: not isinstance(v, fx.Node) and not (isinstance(v, (list, tuple)) and any(isinstance(i, fx.Node) for i in v))  # noqa: E731
    assert all(no_nodes(v) for call in stored.values() for v in call.args.values())
    twin = copy.deepcopy(gm)  # no rebinding: the copy's calls resolve to the copy's own nodes
    nodes = {n.name: n for n in twin.graph.nodes}
    bound = canonical(nodes["cat"])
    assert bound.args["tensors"][0] is nodes["sigmoid"] and bound.args["tensors"][1] is nodes["y"]
    assert canonical(nodes["add"]).tensor_inputs() == [nodes["cat"], nodes["x"]]
    assert canonical(next(n for n in gm.graph.nodes if n.name == "cat")).args["tensors"][0] is not nodes["sigmoid"]
