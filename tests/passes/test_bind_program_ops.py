"""bind_program_ops: a program's oneDNN calls are bound calls, computing what the torch.ops calls compute."""

import torch
from torch import fx, nn

import lucid_fx
from lucid_fx._meta import BOUND_OP
from lucid_fx.kernels import bound_ops
from lucid_fx.passes import bind_program_ops as bind_pass
from lucid_fx.program import programs_of


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU())
        self.body = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.Conv2d(16, 16, 3, padding=1))
        self.head = nn.Linear(16, 10)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.body(x) + x)
        return self.head(x.mean((2, 3)))


def _program(model, x, batches):
    q = lucid_fx.quantize(model, (x,), batches, progress=False)
    with torch.no_grad():
        q(x)  # the portable graph, recording; builds the program
        q(x)  # the program's first call, planning
        out = q(x)
    (program,) = programs_of(q).values()
    return program, out


def _onednn_calls(program):
    return [n for n in program.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "onednn"]


def test_onednn_calls_become_bound_calls_with_the_same_values(bound_ops_on, monkeypatch):
    torch.manual_seed(0)
    model, x = Residual().eval(), torch.randn(2, 3, 16, 16)
    batches = [torch.randn(2, 3, 16, 16) for _ in range(4)]
    bound, out = _program(model, x, batches)
    monkeypatch.setattr(bound_ops, "bind", lambda *args: None)  # as where the bound calls are not built
    kept, expected = _program(model, x, batches)
    ops = [n.target for n in _onednn_calls(kept)]
    assert ops, "this CPU kind's program calls oneDNN (else this test checks nothing)"
    calls = [n for n in bound.graph.nodes if BOUND_OP in n.meta]
    assert [n.meta[BOUND_OP].op for n in calls] == ops and not _onednn_calls(bound)
    assert calls[0].meta[BOUND_OP].args[1:3] == _onednn_calls(kept)[0].args[1:3], "its input's scale and zero point"
    assert [n.name for n in calls] == [n.name for n in _onednn_calls(kept)], "each keeps the portable node's name"
    assert all(n.target is bind_pass._CALL and len(n.args) in (2, 3) for n in calls), "the call takes its tensors only"
    assert "torch.ops.onednn" not in bound.code and "torch.ops.onednn" in kept.code
    assert torch.equal(out, expected)


def _graph(body):
    """A GraphModule of ``body(graph, x, weight)`` with a tensor attribute ``weight``."""
    root = nn.Module()
    root.weight = torch.randn(4)
    graph = fx.Graph()
    graph.output(body(graph, graph.placeholder("x"), graph.get_attr("weight")))
    return fx.GraphModule(root, graph)


def test_only_positional_calls_of_tensors_and_constants_are_bound(bound_ops_on, monkeypatch):
    monkeypatch.setattr(bind_pass, "BOUND_NAMESPACES", frozenset({"aten"}))
    aten = torch.ops.aten
    module = _graph(lambda g, x, w: g.call_function(aten.add.Tensor, (x, w, 2)))
    assert bind_pass.bind_program_ops(module) == 1
    module.recompile()
    assert not module.graph.find_nodes(op="get_attr", target="weight"), "the bound call holds the constant"
    x = torch.randn(4)
    assert torch.equal(module(x), x + 2 * module.weight)
    for body in (lambda g, x, w: g.call_function(aten.add.Tensor, (x, w), {"alpha": 2}),  # keywords
                 lambda g, x, w: g.call_function(aten.cat.default, ([x, w],)),  # a list of graph values
                 lambda g, x, w: g.call_function(aten.max.dim, (x, 0))):  # two results
        assert bind_pass.bind_program_ops(_graph(body)) == 0


def test_other_namespaces_are_left_alone(bound_ops_on):
    module = _graph(lambda g, x, w: g.call_function(torch.ops.aten.add.Tensor, (x, w)))
    assert bind_pass.bind_program_ops(module) == 0
    assert [n.target for n in module.graph.nodes if n.op == "call_function"] == [torch.ops.aten.add.Tensor]


def test_without_bound_calls_the_program_keeps_torch_ops(monkeypatch):
    monkeypatch.setattr(bound_ops, "bind", lambda *args: None)
    monkeypatch.setattr(bind_pass, "BOUND_NAMESPACES", frozenset({"aten"}))
    module = _graph(lambda g, x, w: g.call_function(torch.ops.aten.add.Tensor, (x, w)))
    assert bind_pass.bind_program_ops(module) == 0
    assert [n.target for n in module.graph.nodes if n.op == "call_function"] == [torch.ops.aten.add.Tensor]
