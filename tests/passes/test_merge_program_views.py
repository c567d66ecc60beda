"""passes/merge_program_views.py: a program takes each view of a value once; ``view_as(x, x)`` is ``x``."""

import operator

import torch
from torch import fx

from lucid_fx.passes.merge_program_views import merge_program_views


def _program(body) -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(body(graph, x))
    return fx.GraphModule(torch.nn.Module(), graph)


def _calls(gm: fx.GraphModule) -> list:
    return [n.target if isinstance(n.target, str) else n.target.__name__ for n in gm.graph.nodes
            if n.op in ("call_function", "call_method")]


def test_gpt2s_three_splits_are_one_and_a_view_of_itself_is_the_value():
    def body(g, x):
        parts = []
        for i in range(3):  # torch.export's GPT-2: split(qkv, 64, 2) once for each part read
            split = g.call_function(torch.split, (x, 2, 1))
            parts.append(g.call_function(operator.getitem, (split, i)))
        same = g.call_method("view_as", (parts[0], parts[0]))
        return g.call_function(torch.cat, ([same, parts[1], parts[2]], 1))

    gm = _program(body)
    x = torch.arange(12.0).reshape(2, 6)
    expected = gm(x)
    assert merge_program_views(gm) == 3
    gm.recompile()
    assert _calls(gm) == ["split", "getitem", "getitem", "getitem", "cat"]
    assert torch.equal(gm(x), expected)


def test_tensor_splits_of_one_value_are_one():
    def body(g, x):  # transformers' Mamba: one tensor_split read twice
        parts = [g.call_function(operator.getitem, (g.call_method("tensor_split", (x, [2], 1)), i)) for i in (0, 1)]
        return g.call_function(torch.cat, (parts, 1))

    gm = _program(body)
    x = torch.arange(12.0).reshape(2, 6)
    assert merge_program_views(gm) == 1
    gm.recompile()
    assert _calls(gm) == ["tensor_split", "getitem", "getitem", "cat"] and torch.equal(gm(x), x)


def test_views_that_differ_or_may_copy_are_kept():
    def body(g, x):
        a = g.call_function(torch.transpose, (x, 0, 1))
        b = g.call_function(torch.transpose, (x, 1, 0))  # another spelling: kept (not compared by meaning)
        c = g.call_method("view", (x, 6, 2))
        d = g.call_method("view", (x, 4, 3))  # other arguments
        e = g.call_function(torch.reshape, (x, (6, 2)))
        f = g.call_function(torch.reshape, (x, (6, 2)))  # a reshape may copy: two values
        other = g.call_method("view_as", (x, c))  # viewed as another value: not the identity
        return a, b, c, d, e, f, other

    gm = _program(body)
    assert merge_program_views(gm) == 0
    assert _calls(gm).count("reshape") == 2 and _calls(gm).count("view_as") == 1


def test_a_merged_view_reads_a_write_in_place_as_before():
    # the second transpose is taken after x is written in place; the one left reads the same storage
    def body(g, x):
        before = g.call_function(torch.transpose, (x, 0, 1))
        total = g.call_method("sum", (before,))
        g.call_method("mul_", (x, 2.0))
        after = g.call_function(torch.transpose, (x, 0, 1))
        return total, g.call_method("clone", (after,))

    gm = _program(body)
    expected = gm(torch.arange(6.0).reshape(2, 3))
    assert merge_program_views(gm) == 1
    gm.recompile()
    got = gm(torch.arange(6.0).reshape(2, 3))
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert torch.equal(got[1], torch.arange(6.0).reshape(2, 3).t() * 2)


def test_the_gpt2_like_programs_split_once_a_layer_and_read_the_same_codes():
    import lucid_fx
    from lucid_fx.program import programs_of
    from tests.models.families import FAMILIES, as_batch
    from tests.models.measure import outputs, positional

    family = FAMILIES["gpt2"]
    model, (args, kwargs) = family.make_model(), family.example_inputs()
    prepared = lucid_fx.prepare(model, example_inputs=positional(model, (args, kwargs)))
    lucid_fx.calibrate(prepared, [as_batch(b) for b in family.calibration_batches(2)], progress=False)
    qmodel = lucid_fx.convert(prepared)
    with torch.no_grad():
        portable = outputs(qmodel(*args, **kwargs))  # the first call runs the portable graph
        program_run = outputs(qmodel(*args, **kwargs))
    (program,) = [p for p in programs_of(qmodel).values() if p is not None]
    calls = [n for n in program.graph.nodes if n.op in ("call_function", "call_method")]
    layers = sum(1 for name, _ in model.named_modules() if name.endswith(".attn"))
    assert layers == 2 and sum(n.target is torch.split for n in calls) == layers  # torch.export wrote three a layer
    assert not [n for n in calls if n.target == "view_as" and n.args[0] is n.args[1]]
    assert torch.equal(program_run, portable)
