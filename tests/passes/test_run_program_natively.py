"""run_program_natively: a program's graph runs from C++ (bound_ops.cpp's NativeProgram) with its generated forward's
values, calls a planned step's Python function only where the step refuses, drops values after their last read,
and leaves the generated forward where it cannot take the graph."""

import inspect
import operator
import sys
import weakref

import pytest
import torch
from torch import fx

import lucid_fx
from lucid_fx.kernels import bound_ops, native, native_lut, row_plan
from lucid_fx.kernels.native_step import returns_step
from lucid_fx.passes import call_float_modules
from lucid_fx.passes.bind_program_ops import _CALL
from lucid_fx.passes.run_program_natively import native_forward, run_program_natively
from lucid_fx.program import programs_of
from lucid_fx.rules.program_cpu import PROGRAM_PLANS_CPU
from models import EfficientNetLike, _init_bn


def _module(build, **attributes) -> fx.GraphModule:
    root = torch.nn.Module()
    for name, value in attributes.items():
        root.__dict__[name] = value  # plain attributes, as a program's constants
    graph = fx.Graph()
    build(graph)
    return fx.GraphModule(root, graph)


def _every_kind(graph):
    x, y = graph.placeholder("x"), graph.placeholder("y")
    weight = graph.get_attr("weight")
    parts = graph.call_function(torch.split_with_sizes, (x, [2, 2], -1))
    first = graph.call_function(operator.getitem, (parts, 0))
    second = graph.call_function(operator.getitem, (parts, 1))
    summed = graph.call_function(torch.add, (first, second), {"alpha": 2})  # a keyword
    scaled = graph.call_function(torch.mul, (summed, weight))  # a constant tensor
    flat = graph.call_method("reshape", (scaled, (-1,)))  # a method
    joined = graph.call_function(torch.cat, ([flat, y],), {"dim": 0})  # a list of values
    graph.output((joined, first))  # a tuple of values


def test_a_graph_runs_with_its_generated_forwards_values(bound_ops_on):
    gm = _module(_every_kind, weight=torch.randn(3, 2))
    program = native_forward(gm)
    assert type(program).__name__ == "NativeProgram"
    x, y = torch.randn(3, 4), torch.randn(5)
    got, want = program(x, y), gm.forward(x, y)
    assert type(got) is tuple and len(got) == 2
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(got[0][:6], ((x[:, :2] + 2 * x[:, 2:]) * gm.weight).reshape(-1))
    assert repr(program) == "<lucid_fx native program: 9 calls (2 bound, 0 planned, 5 Python)>"  # and 2 packs


def test_keywords_and_defaults_bind_as_in_the_generated_forward(bound_ops_on):
    def build(graph):
        x = graph.placeholder("x")
        shift = graph.placeholder("shift", default_value=3.0)
        graph.output(graph.call_function(torch.add, (x, shift)))

    gm = _module(build)
    program, x = native_forward(gm), torch.randn(4)
    assert torch.equal(program(x), x + 3.0) and torch.equal(program(x, 1.0), x + 1.0)
    assert torch.equal(program(shift=2.0, x=x), x + 2.0)
    with pytest.raises(TypeError, match="missing argument 'x'"):
        program()
    with pytest.raises(TypeError, match="unexpected or repeated argument 'scale'"):
        program(x, scale=1.0)
    with pytest.raises(TypeError, match="unexpected or repeated argument 'x'"):
        program(x, x=x)
    with pytest.raises(TypeError, match="takes 2 arguments, got 3"):
        program(x, 1.0, 2.0)


def _held(seen):
    def make(x):
        out = x * 2
        seen.append(weakref.ref(out))
        return out

    def alive(x):
        return torch.tensor([seen[0]() is not None])

    return make, alive


def test_a_value_is_dropped_after_its_last_read(bound_ops_on):
    seen = []
    make, alive = _held(seen)

    def build(graph):
        x = graph.placeholder("x")
        made = graph.call_function(make, (x,))
        used = graph.call_function(torch.neg, (made,))  # made's last read
        graph.output(graph.call_function(torch.cat, ([used, graph.call_function(alive, (x,))],)))

    out = native_forward(_module(build))(torch.ones(1))
    assert out.tolist() == [-2.0, 0.0]  # made was gone when alive() looked
    seen.clear()

    def kept(graph):  # read again later: still there
        x = graph.placeholder("x")
        made = graph.call_function(make, (x,))
        flag = graph.call_function(alive, (x,))
        graph.output(graph.call_function(torch.cat, ([made, flag],)))

    assert native_forward(_module(kept))(torch.ones(1)).tolist() == [2.0, 1.0]


def test_an_error_inside_a_call_is_raised_as_it_was(bound_ops_on):
    def fails(x):
        raise ValueError(f"no codes for a {tuple(x.shape)} input")

    def build(graph):
        graph.output(graph.call_function(fails, (graph.placeholder("x"),)))

    with pytest.raises(ValueError, match=r"no codes for a \(2,\) input"):
        native_forward(_module(build))(torch.ones(2))


def test_a_bound_call_runs_its_operator(bound_ops_on):
    bound = bound_ops.bind(torch.ops.aten.sub.Tensor, [None, torch.tensor(1.5), 2], [0])

    def build(graph):
        graph.output(graph.call_function(_CALL, (graph.get_attr("bound"), graph.placeholder("x"))))

    program = native_forward(_module(build, bound=bound))
    x = torch.randn(6)
    assert torch.equal(program(x), x - 3.0)
    assert repr(program) == "<lucid_fx native program: 1 calls (1 bound, 0 planned, 0 Python)>"


def _lookup_program(lookup):
    q, table = torch.randint(0, 256, (3, 5), dtype=torch.uint8), torch.randn(256)
    step = native_lut.lut_plan(q, table)

    def build(graph):
        graph.output(graph.call_function(lookup, (graph.placeholder("q"), graph.get_attr("table")),
                                         {"plan": graph.get_attr("step")}))

    return native_forward(_module(build, table=table, step=step)), q, table


def test_a_planned_call_runs_its_step_and_its_function_only_where_the_step_refuses(bound_ops_on, native_here):
    calls = []

    @returns_step("q", "table")
    def lookup(q, table, plan):
        calls.append(tuple(q.shape))
        out = plan(q, table)
        return out if out is not None else table[q.long()]

    program, q, table = _lookup_program(lookup)
    assert repr(program) == "<lucid_fx native program: 1 calls (0 bound, 1 planned, 0 Python)>"
    assert torch.equal(program(q), table[q.long()]) and calls == []  # the step ran, not the function
    other = torch.randint(0, 256, (4, 5), dtype=torch.uint8)
    assert torch.equal(program(other), table[other.long()]) and calls == [(4, 5)]  # refused: the function ran


def test_a_function_given_a_step_runs_itself_unless_marked(bound_ops_on, native_here):
    def lookup_then_negate(q, table, plan):  # more than its step: not marked returns_step
        return -plan(q, table)

    program, q, table = _lookup_program(lookup_then_negate)
    assert repr(program) == "<lucid_fx native program: 1 calls (0 bound, 0 planned, 1 Python)>"
    assert torch.equal(program(q), -table[q.long()])

    @returns_step("q", step="plan")  # marked, but the step takes two operands: the generated forward, and why
    def wrongly_marked(q, table, plan):
        return plan(q, table)

    with pytest.warns(RuntimeWarning, match="takes 2 operands"):
        assert _lookup_program(wrongly_marked)[0] is None


def test_what_it_does_not_take_keeps_the_generated_forward(bound_ops_on, monkeypatch):
    def a_dict_argument(graph):
        x = graph.placeholder("x")
        graph.output(graph.call_function(torch.add, ({"a": x}, 1)))

    assert native_forward(_module(a_dict_argument)) is None
    gm = _module(_every_kind, weight=torch.randn(3, 2))
    gm.graph.set_codegen(fx.graph._PyTreeCodeGen(fx.graph._PyTreeInfo(["x", "y"], None, None)))
    assert native_forward(gm) is None  # a forward with the model's call structure
    monkeypatch.setattr(bound_ops, "module", lambda: None)
    plain = _module(_every_kind, weight=torch.randn(3, 2))
    assert native_forward(plain) is None and not run_program_natively(plain) and "forward" not in plain.__dict__


def _efficientnet():
    torch.manual_seed(0)
    model = _init_bn(EfficientNetLike(num_classes=10)).eval()
    data = [torch.randn(1, 3, 32, 32) for _ in range(3)]
    return lucid_fx.quantize(model, (data[0],), data), data[0]


def test_a_converted_models_program_runs_natively_and_no_planned_function_runs(bound_ops_on, native_here):
    q, x = _efficientnet()
    portable = q(x)
    q(x)  # the program's first call plans it, then installs its native forward
    (program,) = programs_of(q).values()
    native = program.__dict__["forward"]
    assert type(native).__name__ == "NativeProgram"
    step = bound_ops.module().NativeStep
    planned = {n.target.__code__ for n in program.graph.nodes  # calls planned as native steps (not Python closures)
               if "plan" in n.kwargs and isinstance(getattr(program, n.kwargs["plan"].target), step)}
    assert len(planned) >= 3 and "planned" in repr(native)
    ran = set()
    sys.setprofile(lambda frame, event, arg: ran.add(frame.f_code) if event == "call" else None)
    try:
        out = q(x)
    finally:
        sys.setprofile(None)
    assert torch.equal(out, portable) and torch.equal(out, type(program).forward(program, x))
    assert not planned & ran, sorted(c.co_name for c in planned & ran)  # each step took its operands


def test_the_planned_kernel_functions_are_marked_with_parameters_they_have():
    unmarked = {fn for fn in PROGRAM_PLANS_CPU if not hasattr(fn, "returns_step")}
    assert unmarked == {native.post_op_codes}  # its result is its post-op's, then its step's: it runs itself
    for fn in [*PROGRAM_PLANS_CPU, row_plan.planned_rows, row_plan.planned_rows_add]:
        step, operands = getattr(fn, "returns_step", ("plan", ()))
        assert {step, *operands} <= set(inspect.signature(fn).parameters), fn.__name__


_X = torch.randn(2, 3, 4, 5)
ATEN_CASES = [  # (method name or function, arguments after the tensor, keywords)
    ("reshape", (6, 20), {}), ("reshape", ((-1, 5),), {}), ("view", (2, 60), {}), ("permute", (3, 0, 2, 1), {}),
    ("transpose", (1, -1), {}), ("contiguous", (), {"memory_format": torch.channels_last}), ("contiguous", (), {}),
    ("flatten", (1,), {}), ("clone", (), {"memory_format": torch.contiguous_format}), ("unsqueeze", (0,), {}),
    (torch.reshape, ((4, 30),), {}), (torch.permute, ((1, 0, 2, 3),), {}), (torch.transpose, (0, 2), {}),
    (torch.flatten, (1,), {}), (torch.split_with_sizes, ([1, 2], 1), {}), (torch.addcmul, (_X, _X), {"value": 0.5}),
    (torch.layer_norm, ((5,), torch.randn(5), torch.randn(5), 1e-5), {}), (operator.getitem, (1,), {}),
]


@pytest.mark.parametrize("call, args, kwargs", ATEN_CASES, ids=[f"{c if isinstance(c, str) else c.__name__}-{i}"
                                                                  for i, (c, _, _) in enumerate(ATEN_CASES)])
def test_a_view_or_float_op_runs_as_its_bound_aten_operator(bound_ops_on, call, args, kwargs):
    constants = {f"c{i}": a for i, a in enumerate(args) if isinstance(a, torch.Tensor)}  # tensors: program attributes

    def build(graph):
        x = graph.placeholder("x")
        x.meta["val"] = _X  # (what a program's values carry: getitem binds on a tensor only)
        given = tuple(graph.get_attr(f"c{i}") if f"c{i}" in constants else a for i, a in enumerate(args))
        if isinstance(call, str):
            graph.output(graph.call_method(call, (x, *given), kwargs))
        else:
            graph.output(graph.call_function(call, (x, *given), kwargs))

    gm = _module(build, **constants)
    program = native_forward(gm)
    assert repr(program) == "<lucid_fx native program: 1 calls (1 bound, 0 planned, 0 Python)>"
    got, want = program(_X), gm.forward(_X)
    for g, w in zip(got, want) if isinstance(want, tuple) else [(got, want)]:
        assert torch.equal(g, w) and g.shape == w.shape and g.stride() == w.stride()
        assert (g.data_ptr() == _X.data_ptr()) == (w.data_ptr() == _X.data_ptr())  # a view where Python's is one
    assert type(got) is type(want)


def test_a_list_item_stays_a_python_call_and_a_dtype_view_its_method(bound_ops_on):
    def build(graph):
        x = graph.placeholder("x")
        parts = graph.call_function(torch.split_with_sizes, (x, [1, 1]))
        first = graph.call_function(operator.getitem, (parts, 0))  # a list's item
        graph.output(graph.call_method("view", (first, torch.int32)))  # view(dtype): not aten::view

    gm, x = _module(build), torch.randn(2, 3)
    program = native_forward(gm)
    assert repr(program) == "<lucid_fx native program: 3 calls (1 bound, 0 planned, 2 Python)>"
    assert torch.equal(program(x), x[:1].view(torch.int32))


def test_a_float_layer_norm_runs_its_operator_unless_the_module_has_hooks(bound_ops_on):
    norm = torch.nn.LayerNorm(8).eval()
    torch.nn.init.normal_(norm.weight)

    def build(graph):
        x = graph.placeholder("x")
        graph.output(graph.call_function(call_float_modules.layer_norm, (x, graph.get_attr("norm"), (8,),
                                                                          graph.get_attr("weight"), norm.bias, 1e-5)))

    program = native_forward(_module(build, norm=norm, weight=norm.weight))
    assert repr(program) == "<lucid_fx native program: 1 calls (1 bound, 0 planned, 0 Python)>"
    x = torch.randn(3, 8)
    with torch.no_grad():
        assert torch.equal(program(x), norm(x))
        seen = []
        handle = norm.register_forward_hook(lambda module, inputs, out: seen.append(out) or out * 2)
        assert torch.equal(program(x), 2 * seen[0]) and len(seen) == 1  # the module's call, its hook
        handle.remove()
        assert torch.equal(program(x), norm(x)) and len(seen) == 1
