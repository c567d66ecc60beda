"""Programs in tests: a converted model's portable output and the CPU program lowered from it, to
hold the program's codes equal to the portable graph's and see which calls it makes; a graph cut at
one of its nodes, to read that node's value."""

import torch

from lucid_fx._meta import BOUND_OP
from lucid_fx.passes.lower_to_program import lower_to_program, record_values


def called(node: torch.fx.Node):
    """What a program's call runs: its target, or for a bound call (passes/bind_program_ops.py) its operator."""
    bound = node.meta.get(BOUND_OP)
    return node.target if bound is None else bound.op


def operands(node: torch.fx.Node) -> tuple:
    """A program call's arguments; a bound call's as its ``torch.ops`` call had them (constants as values)."""
    bound = node.meta.get(BOUND_OP)
    return node.args if bound is None else bound.args


def lowered(qmodel, x):
    """(the portable graph's output on ``x``, the CPU program built for ``x``'s signature, its called targets)."""
    portable, values = record_values(qmodel, (x,))
    program = lower_to_program(qmodel, values, "cpu")
    return portable, program, [called(n) for n in program.graph.nodes if n.op == "call_function"]


def graph_until(graph: torch.fx.Graph, node: torch.fx.Node) -> torch.fx.Graph:
    """A copy of ``graph`` whose output is ``node``'s value."""
    new, env = torch.fx.Graph(), {}
    for n in graph.nodes:
        if n.op == "output":
            continue
        env[n] = new.node_copy(n, lambda a: env[a])
        if n is node:
            break
    new.output(env[node])
    return new
