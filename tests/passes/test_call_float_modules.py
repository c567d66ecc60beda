"""call_float_modules: a program's float layer norms are direct torch.layer_norm calls, with the module's values."""

import torch
from torch import fx, nn

import lucid_fx
from lucid_fx.passes.call_float_modules import call_float_modules, layer_norm
from lucid_fx.program import programs_of


class ScaledNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x) * 2


def _converted(norm: nn.Module):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), norm, nn.Linear(16, 8)).eval()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.uniform_(-0.5, 0.5)
    batches = [torch.randn(4, 16) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    x = torch.randn(4, 16)
    with torch.no_grad():
        portable = nn.Module.__call__(qmodel, x)
        qmodel(x)  # builds the program
        out = qmodel(x)  # runs it
    (program,) = programs_of(qmodel).values()
    return qmodel, program, x, portable, out


def test_a_float_layer_norm_is_a_direct_call_with_the_portable_values():
    qmodel, program, x, portable, out = _converted(nn.LayerNorm(16))
    assert [n.target for n in qmodel.graph.nodes if n.op == "call_module"] == ["1"]  # float in the portable graph
    calls = [n for n in program.graph.nodes if n.target is layer_norm]
    assert len(calls) == 1 and not list(program.graph.find_nodes(op="call_module"))
    assert calls[0].name == "_1", "the call keeps the portable node's name"
    assert torch.equal(out, portable)


def test_a_hook_added_after_the_program_was_built_still_runs():
    qmodel, program, x, portable, _ = _converted(nn.LayerNorm(16))
    seen = []
    handle = qmodel.get_submodule("1").register_forward_hook(lambda m, args, y: seen.append(y.shape) or y + 1)
    try:
        with torch.no_grad():
            hooked = qmodel(x)
    finally:
        handle.remove()
    assert programs_of(qmodel)[next(iter(programs_of(qmodel)))] is program  # the program ran, not the portable graph
    assert seen == [torch.Size([4, 16])] and not torch.equal(hooked, portable)  # its result replaced the norm's
    with torch.no_grad():
        assert torch.equal(qmodel(x), portable)


def test_a_subclass_keeps_its_own_forward():
    root = nn.Module()
    root.plain, root.scaled = nn.LayerNorm(16), ScaledNorm(16)
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_module("scaled", (graph.call_module("plain", (x,)),)))
    gm = fx.GraphModule(root, graph)
    data = torch.randn(3, 16)
    expected = gm(data)
    assert call_float_modules(gm) == 1
    gm.recompile()
    assert [n.target for n in gm.graph.find_nodes(op="call_module")] == ["scaled"]
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [layer_norm]
    assert torch.equal(gm(data), expected)
