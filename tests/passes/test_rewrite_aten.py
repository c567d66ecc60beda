"""rewrite_aten: the graph rewrites beyond reordering arguments (a transposed weight, no-op calls,
in-place writes, ops the table does not know). The per-row tests are tests/rules/test_aten_ops.py."""

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

import lucid_fx
from lucid_fx.passes.rewrite_aten import rewrite_aten

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)


def t(*shape):
    return torch.randn(*shape, generator=g)


def test_addmm_on_a_transposed_weight_reads_the_weight_itself():
    root, graph = nn.Module(), fx.Graph()
    root.w = nn.Parameter(t(3, 4), requires_grad=False)
    x = graph.placeholder("x")
    w = graph.get_attr("w")
    b = graph.placeholder("b")
    x.append(b)
    out = graph.call_function(aten.addmm.default, (b, x, graph.call_function(aten.t.default, (w,))))
    graph.output(out)
    gm = fx.GraphModule(root, graph)
    x_val, b_val = t(2, 4), t(3)
    expected = gm(x_val, b_val)
    rewrite_aten(gm)
    linear = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert linear.target is torch.nn.functional.linear and linear.args[1].target == "w"
    torch.testing.assert_close(gm(x_val, b_val), expected)


def test_no_op_aten_calls_go_and_asserts_are_dropped():
    root, graph = nn.Module(), fx.Graph()
    x = graph.placeholder("x")
    graph.call_function(aten._assert_tensor_metadata.default, (x,), {"dtype": torch.float32})
    y = graph.call_function(aten.alias.default, (graph.call_function(aten.clone.default, (x,)),))
    graph.output(graph.call_function(aten.relu.default, (y,)))
    gm = rewrite_aten(fx.GraphModule(root, graph))
    assert [(n.op, getattr(n.target, "__name__", n.target)) for n in gm.graph.nodes] == [
        ("placeholder", "x"), ("call_function", "relu"), ("output", "output")]


def test_a_clone_that_an_in_place_op_writes_stays():
    root, graph = nn.Module(), fx.Graph()
    x, y = graph.placeholder("x"), graph.placeholder("y")
    c = graph.call_function(aten.clone.default, (x,))
    graph.call_function(aten.copy_.default, (c, y))
    graph.output(c)
    gm = rewrite_aten(fx.GraphModule(root, graph))
    xv, yv = t(2, 3), t(2, 3)
    torch.testing.assert_close(gm(xv.clone(), yv), yv)
    assert [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes if n.op.startswith("call")] == ["clone", "copy_"]


def test_a_clone_written_through_a_view_of_it_stays():
    # clone -> slice -> add_: dropping the clone wrote into x itself
    root, graph = nn.Module(), fx.Graph()
    x = graph.placeholder("x")
    c = graph.call_function(aten.clone.default, (x,))
    part = graph.call_function(aten.slice.Tensor, (c, 1, 0, 2))
    graph.call_function(aten.add_.Tensor, (part, 1.0))
    graph.output(c)
    gm = rewrite_aten(fx.GraphModule(root, graph))
    xv = t(2, 3)
    before = xv.clone()
    torch.testing.assert_close(gm(xv), torch.cat([before[:, :2] + 1, before[:, 2:]], 1))
    assert torch.equal(xv, before), "the input was written"
    assert "clone" in [getattr(n.target, "__name__", n.target) for n in gm.graph.nodes if n.op.startswith("call")]


class ClonedBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.register_buffer("offset", torch.ones(4, 8))

    def forward(self, x):
        offset = self.offset.clone()
        offset[:, :2] += 1  # export: clone -> slice -> add_ -> copy_
        return self.fc(x) + offset


def test_a_model_that_edits_a_copy_of_its_buffer_gives_the_same_answer_every_call():
    # the copy was dropped, so each call added 1 to the buffer: 4, 5, 6 off after three calls
    model, x = ClonedBuffer().eval(), t(4, 8)
    prepared = lucid_fx.prepare(model, example_inputs=(x,), capture="export")
    with torch.no_grad():
        expected = model(x)
        assert [float((prepared(x) - expected).abs().max()) for _ in range(3)] == [0.0] * 3
        qmodel = lucid_fx.convert(prepared)
        errors = [float((qmodel(x) - expected).abs().max()) for _ in range(3)]
    assert errors[0] < 0.05 and errors == [errors[0]] * 3, errors


def test_an_aten_op_no_row_or_name_covers_stays_aten():
    root, graph = nn.Module(), fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(aten._adaptive_avg_pool2d.default, (x, [1, 1])))
    gm = rewrite_aten(fx.GraphModule(root, graph))
    assert any(n.target is aten._adaptive_avg_pool2d.default for n in gm.graph.nodes)


def test_mm_of_two_activations_stays_a_matmul():
    root, graph = nn.Module(), fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    graph.output(graph.call_function(aten.mm.default, (a, b)))
    gm = rewrite_aten(fx.GraphModule(root, graph))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [torch.matmul]
    av, bv = t(2, 4), t(4, 3)
    torch.testing.assert_close(gm(av, bv), av @ bv)


def test_addmm_with_beta_stays_addmm_in_float():
    root, graph = nn.Module(), fx.Graph()
    b, x, w = graph.placeholder("b"), graph.placeholder("x"), graph.placeholder("w")
    graph.output(graph.call_function(aten.addmm.default, (b, x, w), {"beta": 2.0}))
    gm = rewrite_aten(fx.GraphModule(root, graph))
    assert [n.target for n in gm.graph.nodes if n.op == "call_function"] == [aten.addmm.default]


@pytest.mark.parametrize("dims,becomes", [(2, F.conv_transpose2d), (1, aten.convolution.default), (3, aten.convolution.default)])
def test_a_transposed_convolution_is_conv_transpose2d_in_2_d_and_stays_aten_otherwise(dims, becomes):
    root, graph = nn.Module(), fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    graph.output(graph.call_function(aten.convolution.default, (x, w, None, [2] * dims, [0] * dims, [1] * dims, True, [1] * dims, 1)))
    gm = rewrite_aten(fx.GraphModule(root, graph))
    calls = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [becomes]
    if dims == 2:  # (input, weight, bias, stride, padding, output_padding, groups, dilation): torch's order
        assert calls[0].args == (x, w, None, [2, 2], [0, 0], [1, 1], 1, [1, 1])
        xs, ws = torch.randn(1, 3, 4, 4), torch.randn(3, 2, 3, 3)
        assert torch.equal(gm(xs, ws), aten.convolution.default(xs, ws, None, [2, 2], [0, 0], [1, 1], True, [1, 1], 1))
