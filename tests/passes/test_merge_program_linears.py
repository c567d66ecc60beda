"""passes/merge_program_linears.py: sibling int8 linears with float results run as one GEMM in a program."""

import torch
from torch import nn

import lucid_fx
from lucid_fx.kernels import linear_row as lr
from lucid_fx.kernels import resolve_target
from lucid_fx.kernels.library import op_name
from lucid_fx.passes.merge_program_linears import PREFIX
from lucid_fx.program import programs_of


class Gated(nn.Module):
    """Two linears of one input, their float results read by elementwise ops only (tanh * sigmoid)."""

    def __init__(self, width=64):
        super().__init__()
        self.value, self.gate, self.out = nn.Linear(width, 48), nn.Linear(width, 48), nn.Linear(48, width)

    def forward(self, x):
        return self.out(torch.tanh(self.value(x)) * torch.sigmoid(self.gate(x)))


class Heads(nn.Module):
    """Two linears of one input whose results are codes for int8 linears (kept apart)."""

    def __init__(self, width=64):
        super().__init__()
        self.a, self.b = nn.Linear(width, 32), nn.Linear(width, 32)
        self.c, self.d = nn.Linear(32, 8), nn.Linear(32, 8)

    def forward(self, x):
        return self.c(torch.relu(self.a(x))) + self.d(torch.relu(self.b(x)))


def _program(model, rows=16):
    """The program of ``model`` converted, its output and the portable graph's, and the portable linears' names."""
    torch.manual_seed(0)
    model = model.eval()
    batches = [torch.randn(rows, 64) for _ in range(4)]
    qmodel = lucid_fx.quantize(model, (batches[0],), batches, progress=False)
    x = torch.randn(rows, 64)
    with torch.no_grad():
        y = qmodel(x)
        portable = nn.Module.__call__(qmodel, x)
    (program,) = programs_of(qmodel).values()
    assert program is not None
    return program, y, portable, [n.name for n in qmodel.graph.nodes if op_name(n) == "linear"]


def _calls(program):
    # a portable call's value keeps its node's name in the program, whatever the CPU's route for it
    return {n.name: str(n.target) for n in program.graph.nodes if n.op in ("call_function", "call_method")}


def test_siblings_with_float_results_run_as_one_linear_split_into_views():
    program, y, portable, (value, gate, out) = _program(Gated())
    calls = _calls(program)
    assert value not in calls and gate not in calls and out in calls, calls  # value and gate: one call
    assert sum("split" in target for target in calls.values()) == 1
    assert [n.target for n in program.graph.nodes if "split" in str(n.target)] == [torch.split_with_sizes]  # no Python
    assert torch.equal(y, portable), "the codes of the portable graph"
    assert not [name for name in program.__dict__ if name.startswith(PREFIX)], "the stacked weights were packed, then dropped"
    engine = lr.row_engine(resolve_target("cpu"))
    if engine is not None and "tanh" in lr.engine_post_ops(engine):  # lucid_fx's GEMM, its tanh in the epilogue
        assert not any("onednn" in target for target in calls.values()), calls


def test_siblings_whose_results_are_codes_stay_apart():
    program, y, portable, linears = _program(Heads())
    calls = _calls(program)
    assert len(linears) == 4 and all(name in calls for name in linears), calls
    assert not any("split" in target for target in calls.values()) and torch.equal(y, portable)
