"""Programs in tests: a converted model's portable output and the CPU program lowered from it, to
hold the program's codes equal to the portable graph's and see which calls it makes."""

from lucid_fx.passes.lower_to_program import lower_to_program, record_values


def lowered(qmodel, x):
    """(the portable graph's output on ``x``, the CPU program built for ``x``'s signature, its called targets)."""
    portable, values = record_values(qmodel, (x,))
    program = lower_to_program(qmodel, values, "cpu")
    return portable, program, [n.target for n in program.graph.nodes if n.op == "call_function"]
