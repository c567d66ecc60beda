"""rewrite_aten: turn the aten calls of a torch.export graph into the torch-level calls torch.fx
records, by the table in lucid_fx/rules/aten_ops.py, so canonicalize_ops gives them the same
canonical ops and every rule applies to both front ends.

Reads and writes no ``node.meta`` key of its own; each rewritten node keeps the meta of the aten
node it replaces (``MODULE_PATH`` included). An aten op that neither a row nor the same-name
lookup covers stays as it is (it runs in float, and save refuses it by name).
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, Optional

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx.rules.aten_ops import DROPPED, IDENTITY, AtenRow, aten_row, bind_schema, same_name_target

__all__ = ["rewrite_aten", "is_aten"]


def is_aten(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "aten"


def _short(target: torch._ops.OpOverload) -> str:
    return f"{target._schema.name.split('::')[-1]}.{target._overloadname}"


def _call(graph: fx.Graph, target: Any, args: tuple, kwargs: Dict[str, Any]) -> fx.Node:
    kind = "call_method" if isinstance(target, str) else "call_function"
    return graph.create_node(kind, target, args, kwargs)


def _by_row(gm: fx.GraphModule, node: fx.Node, row: AtenRow, bound: Dict[str, Any]) -> Optional[fx.Node]:
    args = tuple(bound[name] for name in row.args if name in bound)
    kwargs = {torch_name: bound[aten_name] for torch_name, aten_name in row.kwargs.items() if aten_name in bound}
    return _call(gm.graph, row.target, args, kwargs)


def _transposed_weight(gm: fx.GraphModule, mat2: Any) -> Optional[fx.Node]:
    """``W`` such that ``mat2 == W.t()``: the input of a t/transpose, or a new attribute holding
    the transposed tensor of a get_attr (GPT-2's Conv1D keeps its weight as [in, out])."""
    if not isinstance(mat2, fx.Node):
        return None
    if mat2.op == "call_function" and mat2.target in (torch.ops.aten.t.default, torch.t) and len(mat2.users) == 1:
        return mat2.args[0]
    if mat2.op == "call_function" and mat2.target in (torch.ops.aten.permute.default, torch.permute) and list(mat2.args[1]) == [1, 0]:
        return mat2.args[0] if len(mat2.users) == 1 else None
    if mat2.op == "get_attr":
        weight = dict(gm.named_parameters()).get(mat2.target)
        if weight is None or weight.dim() != 2:
            return None
        name = mat2.target.replace(".", "_") + "_t"
        gm.register_parameter(name, torch.nn.Parameter(weight.detach().t().contiguous(), requires_grad=False))
        attr = gm.graph.get_attr(name)
        attr.meta.update(mat2.meta)
        return attr
    return None


def _addmm(gm, node, row, bound):
    if bound.get("beta", 1) != 1 or bound.get("alpha", 1) != 1:
        return None
    weight = _transposed_weight(gm, bound["mat2"])
    if weight is None or not isinstance(bound["mat1"], fx.Node):
        return _call(gm.graph, torch.addmm, (bound["self"], bound["mat1"], bound["mat2"]), {})
    return _call(gm.graph, F.linear, (bound["mat1"], weight, bound["self"]), {})


def _baddbmm(gm, node, row, bound):
    beta, alpha = bound.get("beta", 1), bound.get("alpha", 1)
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (beta, alpha)):
        return None
    product = _call(gm.graph, torch.matmul, (bound["batch1"], bound["batch2"]), {})
    product = product if alpha == 1 else _call(gm.graph, torch.mul, (product, alpha), {})
    base = bound["self"] if beta == 1 else _call(gm.graph, torch.mul, (bound["self"], beta), {})
    return _call(gm.graph, torch.add, (base, product), {}) if beta != 0 else product


def _mm(gm, node, row, bound):
    weight = _transposed_weight(gm, bound["mat2"])
    if weight is None:
        return _call(gm.graph, torch.matmul, (bound["self"], bound["mat2"]), {})
    return _call(gm.graph, F.linear, (bound["self"], weight), {})


def _convolution(gm, node, row, bound):
    if bound["transposed"]:  # only the 2-d one has a canonical op; the others stay aten, float
        names = ("input", "weight", "bias", "stride", "padding", "output_padding", "groups", "dilation")
        if len(bound["stride"]) != 2:
            return None
        return _call(gm.graph, F.conv_transpose2d, tuple(bound[n] for n in names), {})
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}.get(len(bound["stride"]))
    if fn is None:
        return None
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    return _call(gm.graph, fn, tuple(bound[n] for n in names), {})


def _upsample(gm, node, row, bound):
    """aten's upsampling, as F.interpolate records it: the size or the scales it was given (one of them)."""
    mode = row.kwargs["mode"]
    kwargs = {"size": bound.get("output_size"), "scale_factor": bound.get("scale_factors"), "mode": mode}
    if mode != "nearest":
        kwargs["align_corners"] = bound.get("align_corners", False)
    return _call(gm.graph, F.interpolate, (bound["input"],), kwargs)


def _first_of_tuple(gm, node, row, bound):
    """(out, stats...) ops: the torch function returns ``out`` alone, which every ``[0]`` reads."""
    if any(user.target is not operator.getitem or (user.args[1] != 0 and user.users) for user in node.users):
        return None
    new = _by_row(gm, node, row, bound)
    for user in list(node.users):
        if user.args[1] == 0:
            user.replace_all_uses_with(new)
        gm.graph.erase_node(user)
    return new


def _slice(gm, node, row, bound):
    dim, start, end, step = bound["dim"], bound.get("start"), bound.get("end"), bound.get("step", 1)
    if isinstance(dim, fx.Node):
        return None  # bounds may be nodes (a dynamic dim's size): x[:, :n]
    big = 2**62  # export writes "to the end" as INT64_MAX
    end = None if isinstance(end, int) and end >= big else end
    index = (slice(None),) * dim + (slice(start if start else None, end, None if step == 1 else step),)
    return _call(gm.graph, operator.getitem, (bound["self"], index), {})


def _select(gm, node, row, bound):
    dim, index = bound["dim"], bound["index"]
    if not isinstance(dim, int) or dim < 0:
        return None
    return _call(gm.graph, operator.getitem, (bound["self"], (slice(None),) * dim + (index,)), {})


def _index(gm, node, row, bound):
    indices = bound["indices"]
    if not isinstance(indices, (list, tuple)):
        return None
    index = tuple(slice(None) if i is None else i for i in indices)
    return _call(gm.graph, operator.getitem, (bound["self"], index), {})


def _numpy_t(gm, node, row, bound):
    value = bound["self"].meta.get("val") if isinstance(bound["self"], fx.Node) else None
    if not isinstance(value, torch.Tensor):
        return None
    return _call(gm.graph, "permute", (bound["self"], tuple(reversed(range(value.dim())))), {})


SPECIALS: Dict[str, Callable[..., Optional[fx.Node]]] = {
    "addmm": _addmm,  # addmm(b, x, W) -> linear(x, W.t(), b)
    "mm": _mm,  # mm(x, t(W)) -> linear(x, W)
    "baddbmm": _baddbmm,  # baddbmm(b, q, k, beta, alpha) -> b * beta + (q @ k) * alpha
    "convolution": _convolution,  # convolution(..., transposed=False) -> conv{1,2,3}d; transposed 2-d -> conv_transpose2d
    "upsample": _upsample,  # upsample_nearest2d(x, size, scales) -> F.interpolate(x, size, scale_factor=scales, mode=...)
    "first_of_tuple": _first_of_tuple,  # native_layer_norm(...)[0] -> layer_norm(...)
    "slice": _slice,  # slice(x, 1, 0, 4) -> x[:, 0:4]
    "select": _select,  # select(x, 1, 0) -> x[:, 0]
    "index": _index,  # index(x, [None, i]) -> x[:, i]
    "numpy_T": _numpy_t,  # numpy_T(x) -> x.permute(n - 1, ..., 0)
}


def _has_row(target: Any) -> bool:
    """An op of another namespace that the table names (transformers' grouped_mm_fallback)."""
    return isinstance(target, torch._ops.OpOverload) and aten_row(target) is not None


def _mutates(node: fx.Node) -> bool:
    return is_aten(node.target) and node.target._schema.is_mutable


def _written(node: fx.Node) -> bool:
    """Whether an in-place op writes ``node``'s storage, itself or through a view of it (slice,
    select, view, expand, a getitem of split's views): then a copy that made ``node`` must stay, or
    the write lands in what was copied (a buffer, which then changes call after call)."""
    for user in node.users:
        if _mutates(user):
            return True
        views = user.target is operator.getitem or (
            is_aten(user.target) and any(r.alias_info is not None for r in user.target._schema.returns))
        if views and _written(user):
            return True
    return False


def _rewrite(gm: fx.GraphModule, node: fx.Node) -> Optional[fx.Node]:
    short = _short(node.target)
    if short in IDENTITY and not _written(node):
        return node.args[0]
    if short == "_to_copy.default" and node.kwargs.get("dtype") is None and not _written(node):
        return node.args[0]  # a copy on the same device, same dtype
    row = aten_row(node.target)
    if row is None:
        fn = same_name_target(node.target)
        return None if fn is None else _call(gm.graph, fn, node.args, dict(node.kwargs))
    bound = bind_schema(node.target, node.args, node.kwargs)
    return (SPECIALS[row.special] if row.special else _by_row)(gm, node, row, bound)


def rewrite_aten(gm: fx.GraphModule) -> fx.GraphModule:
    """Rewrite every aten call of ``gm`` it has a row for (in place); returns ``gm``."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or not (is_aten(node.target) or _has_row(node.target)):
            continue
        if _short(node.target) in DROPPED and not node.users:
            gm.graph.erase_node(node)
            continue
        with gm.graph.inserting_before(node):
            new = _rewrite(gm, node)
        if new is None:
            continue
        if isinstance(new, fx.Node) and new.op != "get_attr" and new is not node.args[0]:
            new.meta.update({k: v for k, v in node.meta.items() if k not in new.meta})
        node.replace_all_uses_with(new)
        gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code(is_impure_node=_keeps_effect)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm


def _keeps_effect(node: fx.Node) -> bool:
    """In-place calls (``x.copy_(y)``, ``relu_``) change a value another node reads: never dead."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return node.is_impure() or (node.op in ("call_method", "call_function") and isinstance(name, str) and name.endswith("_"))
