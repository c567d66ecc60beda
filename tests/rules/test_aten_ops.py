"""The aten op table: one graph test per row. Each builds a one-op aten graph, rewrites it with
passes/rewrite_aten.py, and checks that the result computes the same values, names no aten op,
and canonicalises to the row's canonical op."""

import operator

import pytest
import torch
from torch import fx, nn

import lucid_fx
from lucid_fx import _meta
from lucid_fx.passes.canonicalize_ops import canonicalize_ops
from lucid_fx.passes.export_model import placeholders_first
from lucid_fx.passes.rewrite_aten import is_aten, rewrite_aten
from lucid_fx.rules.aten_ops import ATEN_OPS, aten_row, same_name_target

aten = torch.ops.aten
g = torch.Generator().manual_seed(0)


def t(*shape):
    return torch.randn(*shape, generator=g)


class W:
    """A tensor argument held by the module (get_attr), as export's unlifted parameters are."""

    def __init__(self, tensor):
        self.tensor = tensor


IDS = torch.tensor([[1, 3, 0], [2, 2, 4]])
OFFS = torch.tensor([2, 6], dtype=torch.int32)
# row -> (aten overload, args, kwargs, index of the tuple result read (None: the result itself))
CASES = {
    "linear.default": (aten.linear.default, (t(2, 4), W(t(3, 4)), W(t(3))), {}, None),
    "addmm.default": (aten.addmm.default, (W(t(3)), t(2, 4), W(t(4, 3))), {}, None),
    "mm.default": (aten.mm.default, (t(2, 4), W(t(4, 3))), {}, None),
    "conv1d.default": (aten.conv1d.default, (t(1, 2, 8), W(t(3, 2, 3)), W(t(3)), [1], [1], [1], 1), {}, None),
    "conv2d.default": (aten.conv2d.default, (t(1, 2, 6, 6), W(t(3, 2, 3, 3)), W(t(3)), [1, 1], [0, 0], [1, 1], 1), {}, None),
    "conv3d.default": (aten.conv3d.default, (t(1, 2, 4, 4, 4), W(t(3, 2, 3, 3, 3)), None, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1), {}, None),
    "convolution.default": (aten.convolution.default, (t(1, 2, 6, 6), W(t(3, 2, 3, 3)), W(t(3)), [2, 2], [1, 1], [1, 1], False, [0, 0], 1), {}, None),
    "upsample_nearest2d.vec": (aten.upsample_nearest2d.vec, (t(1, 2, 3, 3), None, [2.0, 2.0]), {}, None),
    "upsample_bilinear2d.vec": (aten.upsample_bilinear2d.vec, (t(1, 2, 3, 3), [5, 7], False, None), {}, None),
    "layer_norm.default": (aten.layer_norm.default, (t(2, 3, 4), [4], W(t(4)), W(t(4)), 1e-5, True), {}, None),
    "native_layer_norm.default": (aten.native_layer_norm.default, (t(2, 3, 4), [4], W(t(4)), W(t(4)), 1e-5), {}, 0),
    "group_norm.default": (aten.group_norm.default, (t(2, 4, 3, 3), 2, W(t(4)), W(t(4)), 1e-5, True), {}, None),
    "native_group_norm.default": (aten.native_group_norm.default, (t(2, 4, 3, 3), W(t(4)), W(t(4)), 2, 4, 9, 2, 1e-5), {}, 0),
    "instance_norm.default": (aten.instance_norm.default, (t(2, 4, 3, 3), W(t(4)), W(t(4)), None, None, True, 0.1, 1e-5, False), {}, None),
    "batch_norm.default": (aten.batch_norm.default, (t(2, 3, 4, 4), W(t(3)), W(t(3)), W(t(3)), W(t(3).abs() + 0.5), False, 0.1, 1e-5, True), {}, None),
    "_native_batch_norm_legit_no_training.default": (
        aten._native_batch_norm_legit_no_training.default, (t(2, 3, 4, 4), W(t(3)), W(t(3)), W(t(3)), W(t(3).abs() + 0.5), 0.1, 1e-5), {}, 0),
    "embedding.default": (aten.embedding.default, (W(t(5, 4)), IDS), {}, None),
    "hardtanh.default": (aten.hardtanh.default, (t(2, 8), -0.5, 0.5), {}, None),
    "hardtanh_.default": (aten.hardtanh_.default, (t(2, 8), -0.5, 0.5), {}, None),
    "gelu.default": (aten.gelu.default, (t(2, 8),), {"approximate": "tanh"}, None),
    "_softmax.default": (aten._softmax.default, (t(2, 8), -1, False), {}, None),
    "softmax.int": (aten.softmax.int, (t(2, 8), 1), {}, None),
    "_log_softmax.default": (aten._log_softmax.default, (t(2, 8), 1, False), {}, None),
    "dropout.default": (aten.dropout.default, (t(2, 8), 0.5, False), {}, None),
    "dropout_.default": (aten.dropout_.default, (t(2, 8), 0.5, False), {}, None),
    "max_pool2d.default": (aten.max_pool2d.default, (t(1, 2, 6, 6), [2, 2], [2, 2], [0, 0], [1, 1], False), {}, None),
    "max_pool1d.default": (aten.max_pool1d.default, (t(1, 2, 8), [2], [2], [0], [1], True), {}, None),
    "max_pool2d_with_indices.default": (aten.max_pool2d_with_indices.default, (t(1, 2, 6, 6), [3, 3], [2, 2], [1, 1]), {}, 0),
    "view.default": (aten.view.default, (t(2, 6), [3, 4]), {}, None),
    "_unsafe_view.default": (aten._unsafe_view.default, (t(2, 6), [4, 3]), {}, None),
    "expand.default": (aten.expand.default, (t(1, 6), [3, 6]), {}, None),
    "contiguous.default": (aten.contiguous.default, (t(2, 6),), {}, None),
    "slice.Tensor": (aten.slice.Tensor, (t(2, 6, 3), 1, 2, 9223372036854775807, 2), {}, None),
    "split_with_sizes.default": (aten.split_with_sizes.default, (t(2, 6), [2, 4], 1), {}, 1),
    "split.Tensor": (aten.split.Tensor, (t(2, 6), 3, 1), {}, 1),
    "copy_.default": (aten.copy_.default, (t(2, 6), t(2, 6)), {}, None),
    "to.dtype": (aten.to.dtype, (t(2, 6), torch.float32), {}, None),
    "to.dtype_layout": (aten.to.dtype_layout, (t(2, 6),), {"dtype": torch.float64}, None),
    "to.device": (aten.to.device, (t(2, 6), torch.device("cpu"), torch.float64), {}, None),
    "_to_copy.default": (aten._to_copy.default, (t(2, 6),), {"dtype": torch.float64}, None),
    "select.int": (aten.select.int, (t(2, 6, 3), 1, 4), {}, None),
    "sym_size.int": (aten.sym_size.int, (t(2, 6, 3), 1), {}, None),
    "index.Tensor": (aten.index.Tensor, (t(2, 6, 3), [None, torch.tensor([4, 0, 4])]), {}, None),
    "__and__.Tensor": (aten.__and__.Tensor, (t(2, 6) > 0, t(2, 6) > 0.5), {}, None),
    "__or__.Tensor": (aten.__or__.Tensor, (t(2, 6) > 0, t(2, 6) > 0.5), {}, None),
    "numpy_T.default": (aten.numpy_T.default, (t(2, 6, 3),), {}, None),  # x.T: every dim reversed
    "baddbmm.default": (aten.baddbmm.default, (t(2, 3, 5), t(2, 3, 4), t(2, 4, 5)), {"beta": 0.5, "alpha": 0.25}, None),
    # rows 0:2 times the first (K, N), 2:6 times the second (K and N multiples of 4: its CPU kernel's alignment)
    "_grouped_mm.default": (aten._grouped_mm.default, (t(6, 8), W(t(2, 8, 4)), OFFS), {}, None),
}
try:  # transformers' own op (the test extra installs transformers)
    import transformers.integrations.moe  # noqa: F401  (defines transformers::grouped_mm_fallback)

    CASES["transformers::grouped_mm_fallback.default"] = (
        torch.ops.transformers.grouped_mm_fallback.default, (t(6, 8), W(t(2, 8, 4)), OFFS), {}, None)
except ImportError:
    pass


def one_op_graph(overload, args, kwargs, index):
    """A GraphModule computing ``overload(*args, **kwargs)`` (``[index]`` of it), and its inputs."""
    root, graph, inputs = nn.Module(), fx.Graph(), []
    node_args = []
    for i, a in enumerate(args):
        if isinstance(a, W):
            root.register_parameter(f"p{i}", nn.Parameter(a.tensor, requires_grad=False))
            node_args.append(graph.get_attr(f"p{i}"))
        elif isinstance(a, torch.Tensor):
            node_args.append(graph.placeholder(f"x{i}"))
            node_args[-1].meta["val"] = a  # as torch.export records each input (numpy_T reads its rank)
            inputs.append(a.clone())
        elif isinstance(a, list) and any(isinstance(v, torch.Tensor) for v in a):  # index(x, [None, i])
            node_args.append([v if not isinstance(v, torch.Tensor) else graph.placeholder(f"x{i}_{j}") for j, v in enumerate(a)])
            inputs.extend(v.clone() for v in a if isinstance(v, torch.Tensor))
        else:
            node_args.append(a)
    placeholders_first(graph)
    node = graph.call_function(overload, tuple(node_args), kwargs)
    graph.output(node if index is None else graph.call_function(operator.getitem, (node, index)))
    return fx.GraphModule(root, graph), inputs


def test_every_row_has_a_case():
    assert sorted(CASES) == sorted(row.overload for row in ATEN_OPS)


@pytest.mark.parametrize("row", ATEN_OPS, ids=lambda r: r.overload)
def test_row_rewrites_to_its_canonical_op_with_the_same_values(row):
    overload, args, kwargs, index = CASES[row.overload]
    assert aten_row(overload) is row
    gm, inputs = one_op_graph(overload, args, kwargs, index)
    with torch.no_grad():
        expected = gm(*[x.clone() for x in inputs])
    rewrite_aten(gm)
    calls = [n for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert calls and not any(is_aten(n.target) for n in calls), gm.graph
    with torch.no_grad():
        got = gm(*[x.clone() for x in inputs])
    torch.testing.assert_close(got, expected)
    canonicalize_ops(gm, lucid_fx.current_registry())
    ops = [n.meta[_meta.OP].op for n in calls]
    if row.canonical is not None:
        assert row.canonical in ops or (row.special == "convolution" and "conv2d" in ops), ops
    if overload is aten.addmm.default:  # GPT-2's Conv1D: W is [in, out]
        linear = next(n for n in calls if n.meta[_meta.OP].op == "linear")
        assert linear.args[1].op == "get_attr"  # the transposed weight is a parameter the linear rules read
        assert getattr(gm, linear.args[1].target).shape == (3, 4)


def test_ops_without_a_row_become_the_torch_function_of_the_same_name():
    for overload, args, expected_fn in [
        (aten.add.Tensor, (t(2, 3), t(2, 3)), torch.add),
        (aten.mean.dim, (t(2, 3), [1], True), torch.mean),
        (aten.silu.default, (t(2, 3),), torch.nn.functional.silu),
        (aten.add_.Tensor, (t(2, 3), t(2, 3)), "add_"),  # no torch.add_: the method, as fx records `x += y`
        (aten.scaled_dot_product_attention.default, (t(1, 2, 4, 8), t(1, 2, 4, 8), t(1, 2, 4, 8)), torch.nn.functional.scaled_dot_product_attention),
    ]:
        assert same_name_target(overload) is expected_fn or same_name_target(overload) == expected_fn
        gm, inputs = one_op_graph(overload, args, {}, None)
        expected = gm(*[x.clone() for x in inputs])
        rewrite_aten(gm)
        call = next(n for n in gm.graph.nodes if n.op in ("call_function", "call_method"))
        assert call.target is expected_fn or call.target == expected_fn
        torch.testing.assert_close(gm(*[x.clone() for x in inputs]), expected)
        canonicalize_ops(gm, lucid_fx.current_registry())
        canonical = {torch.add: "add", torch.mean: "mean", "add_": "add"}.get(expected_fn) or expected_fn.__name__
        assert call.meta[_meta.OP].op == canonical


def test_rows_name_only_targets_the_save_allowlist_resolves():
    from lucid_fx import _allowlist

    for row in ATEN_OPS:
        if row.target is None:
            continue
        if isinstance(row.target, str):
            assert row.target in _allowlist.TENSOR_METHODS, row
        else:
            assert _allowlist.fn_name(row.target) is not None, row
