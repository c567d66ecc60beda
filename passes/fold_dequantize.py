"""fold_dequantize: compute in float what the int8 graph would only dequantize.

An int8 result that nothing reads as codes (the model's output, a float op's input) is rounded
onto its grid only to be turned back into float. This pass removes that step on the lowered graph,
to a fixpoint, walking from the outputs up:

- ``dequantize(linear | conv1d | conv2d)``: the kernel gives its float result (``out_dtype``
  float32: oneDNN writes float32, no requantize pass, no dequantize pass);
- ``dequantize(add | mul)``: the op runs in float on its dequantized inputs, which may in turn let
  the kernels that feed it give float results (a residual stream that ends the model);
- ``dequantize(cat)``: ``torch.cat`` of the dequantized inputs, each on its own grid (a ViT's tiny
  class token concatenated with the patch embeddings keeps its fine grid instead of the shared one);
- ``dequantize(quantize(x))``: ``x`` itself (an add's float version reads ``x``, not its codes);
- ``dequantize(interpolate(codes))`` (nearest, or a linear mode's codes in float, rounded): the same
  interpolate of the dequantized codes (a segmentation head's final upsampling).

A quantize or dequantize left with no reader by a fold is removed.

Each fold drops one rounding (the result can only get closer to the float model's) and one pass
over the data. Layout calls between the kernel and the dequantize (``contiguous`` to the float
model's memory format) stay and apply to the float result. Reads ``node.meta[QPARAMS]``,
``[SOURCE]``, ``[PLACEMENT]``; drops ``[QPARAMS]`` from nodes that now give float and updates
``[VALUE_TYPE]`` to say so. An add or mul run in float gets a float ``[PLACEMENT]`` (in the convert
report too); a kernel keeps its placement (its rule key), its ``[VALUE_TYPE]`` says float32.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx import _meta
from lucid_fx._placement import ConvertReport, Placement, Runs
from lucid_fx.kernels.library import op_name

__all__ = ["fold_dequantize", "FLOAT_RESULT", "FLOAT_OP", "FOLDS_TO_FLOAT", "FOLDED_SHARED", "FLOAT_WHY"]

_ops = torch.ops.lucid_fx
#: kernels that can give their float result: the position of their ``out_dtype`` argument (their
#: ``out_scale, out_zp`` come three and two before it, then ``post_op``).
FLOAT_RESULT: Dict[str, int] = {"linear": 9, "conv1d": 13, "conv2d": 13}
#: elementwise kernels whose float version is one float op on the dequantized inputs.
FLOAT_OP: Dict[str, Callable] = {"add": torch.add, "mul": torch.mul}
#: the rule keys (first op) whose kernel runs in float once folded: predict_placement says so before convert.
FOLDS_TO_FLOAT = frozenset({"add", "mul", "cat", "stack"})
#: the canonical ops run on codes (shared) that run in float once folded: resampling (``dequantize(interpolate(codes))``).
FOLDED_SHARED = frozenset({"interpolate"})
_POST_OPS = {"relu": torch.relu, "hardswish": F.hardswish, "silu": F.silu}  # applied after the float op
_LAYOUT_METHODS = ("contiguous", "clone")
_BOUNDARY = ("quantize_per_tensor", "dequantize_per_tensor")
FLOAT_WHY = "runs in float: nothing reads its codes, so int8 would only add a rounding"


def _producer(dq: fx.Node) -> tuple:
    """(the node whose codes ``dq`` reads through layout calls, those layout calls): each link read only once."""
    chain: List[fx.Node] = []
    node = dq.args[0]
    while isinstance(node, fx.Node) and node.op == "call_method" and node.target in _LAYOUT_METHODS \
            and len(node.users) == 1:
        chain.append(node)
        node = node.args[0]
    return node, chain


def _to_float_meta(nodes: List[fx.Node]) -> None:
    for node in nodes:
        node.meta.pop(_meta.QPARAMS, None)
        if node.meta.get(_meta.VALUE_TYPE) is not None:
            node.meta[_meta.VALUE_TYPE] = (node.meta[_meta.VALUE_TYPE][0], torch.float32)


def _runs_float(node: fx.Node, report: Optional[ConvertReport]) -> None:
    placement = node.meta.get(_meta.PLACEMENT)
    if placement is None:
        return
    new = Placement(Runs.FLOAT, f"{placement.why} {FLOAT_WHY}", placement.members)
    for name, old in list((report.placements if report is not None else {}).items()):
        if old is placement:
            report.placements[name] = new
    node.meta[_meta.PLACEMENT] = new


def _dequantize(graph: fx.Graph, codes: fx.Node, scale, zp) -> fx.Node:
    """``codes`` in float: the value a quantize read (exact), a dequantize already there, or a new one."""
    if op_name(codes) == "quantize_per_tensor" and tuple(codes.args[1:3]) == (scale, zp):
        return codes.args[0]
    for user in codes.users:
        if op_name(user) == "dequantize_per_tensor" and tuple(user.args[1:]) == (scale, zp):
            codes.append(user)  # moved up to just after the codes: the float op may come before it
            return user
    with graph.inserting_after(codes):
        dq = graph.call_function(_ops.dequantize_per_tensor, (codes, scale, zp))
    dq.meta[_meta.SOURCE] = codes.meta.get(_meta.SOURCE)
    if codes.meta.get(_meta.VALUE_TYPE) is not None:  # a view of codes (x[:, t].unsqueeze(1)) has none: no None either,
        dq.meta[_meta.VALUE_TYPE] = codes.meta[_meta.VALUE_TYPE]  # which load refuses (such a model saved, then failed to load)
    _to_float_meta([dq])
    return dq


def _fold(graph: fx.Graph, dq: fx.Node, report: Optional[ConvertReport]) -> bool:
    producer, chain = _producer(dq)
    resampled = _resampled(graph, producer)
    if resampled is not None:
        _fold_resample(graph, dq, producer, chain, resampled, report)
        return True
    name = op_name(producer)
    if name is None or len(producer.users) != 1:
        return False
    if name == "quantize_per_tensor" and not chain and tuple(dq.args[1:]) == tuple(producer.args[1:3]):
        dq.replace_all_uses_with(producer.args[0])
        graph.erase_node(dq)
        graph.erase_node(producer)
        return True
    if name in FLOAT_RESULT and producer.args[FLOAT_RESULT[name]] is None:
        scale, zp = producer.args[FLOAT_RESULT[name] - 3: FLOAT_RESULT[name] - 1]
        if tuple(dq.args[1:]) != (scale, zp):
            return False
        args = list(producer.args)
        args[FLOAT_RESULT[name]] = torch.float32
        producer.args = tuple(args)
        _to_float_meta([producer, *chain])  # its placement stays the kernel's: the rule key is what reports read
    elif name == "cat" and tuple(dq.args[1:]) == tuple(producer.args[4:6]):
        codes, scales, zps, dim = producer.args[:4]
        parts = [_dequantize(graph, q, s, z) for q, s, z in zip(codes, scales, zps)]
        with graph.inserting_before(producer):
            y = graph.call_function(torch.cat, (parts, dim))
        y.meta.update({k: producer.meta[k] for k in (_meta.SOURCE, _meta.VALUE_TYPE, _meta.PLACEMENT) if k in producer.meta})
        _runs_float(y, report)
        _to_float_meta([y, *chain])
        producer.replace_all_uses_with(y)
        graph.erase_node(producer)
    elif name in FLOAT_OP and tuple(dq.args[1:]) == tuple(producer.args[6:8]):
        qa, a_scale, a_zp, qb, b_scale, b_zp, _, _, post_op = producer.args
        a, b = _dequantize(graph, qa, a_scale, a_zp), _dequantize(graph, qb, b_scale, b_zp)
        with graph.inserting_before(producer):
            y = graph.call_function(FLOAT_OP[name], (a, b))
            if post_op in _POST_OPS:
                y = graph.call_function(_POST_OPS[post_op], (y,))
        computed = [y.args[0], y] if post_op in _POST_OPS else [y]
        for node in computed:
            node.meta.update({k: producer.meta[k] for k in (_meta.SOURCE, _meta.VALUE_TYPE, _meta.PLACEMENT)
                              if k in producer.meta})
            _runs_float(node, report)
        _to_float_meta([*computed, *chain])
        producer.replace_all_uses_with(y)
        graph.erase_node(producer)
    else:
        return False
    dq.replace_all_uses_with(dq.args[0])
    graph.erase_node(dq)
    return True


def _is_interpolate(graph: fx.Graph, node) -> bool:
    if not isinstance(node, fx.Node) or len(node.users) != 1:
        return False
    if node.op == "call_module":
        return isinstance(graph.owning_module.get_submodule(node.target), torch.nn.Upsample)
    return node.op == "call_function" and node.target is F.interpolate


def _resampled(graph: fx.Graph, producer: fx.Node) -> Optional[tuple]:
    """(the interpolate call, the codes it resamples) where ``producer`` is convert's resampling of codes:
    nearest on the codes themselves, or a linear mode's ``quantize(interpolate(codes.to(float32)), 1, 0)``."""
    if op_name(producer) == "quantize_per_tensor" and tuple(producer.args[1:3]) == (1.0, 0):
        call = producer.args[0]
        cast = call.args[0] if _is_interpolate(graph, call) else None
        if isinstance(cast, fx.Node) and cast.op == "call_method" and cast.target == "to" and len(cast.users) == 1:
            return call, cast.args[0]
    return (producer, producer.args[0]) if _is_interpolate(graph, producer) else None


def _fold_resample(graph, dq, producer, chain, resampled, report) -> None:
    """dequantize(resampled codes) -> the same interpolate of the dequantized codes, in float."""
    call, codes = resampled
    old_input = call.args[0]
    call.replace_input_with(old_input, _dequantize(graph, codes, *dq.args[1:]))
    if producer is not call:
        producer.replace_all_uses_with(call)
        graph.erase_node(producer)
        graph.erase_node(old_input)  # the cast of the codes
    _runs_float(call, report)
    _to_float_meta([call, *chain])
    dq.replace_all_uses_with(dq.args[0])
    graph.erase_node(dq)


def fold_dequantize(gm: fx.GraphModule, report: Optional[ConvertReport] = None) -> fx.GraphModule:
    """Fold every dequantize of codes nothing else reads (see the module docstring); works in place."""
    graph = gm.graph
    # Restart after each fold: a fold erases nodes and may make an earlier dequantize foldable.
    while any(op_name(node) == "dequantize_per_tensor" and _fold(graph, node, report) for node in reversed(list(graph.nodes))):
        pass
    for node in reversed(list(graph.nodes)):  # a float op that now reads x, not quantize(x), left it unread
        if op_name(node) in _BOUNDARY and not node.users:
            graph.erase_node(node)
    gm.recompile()
    return gm
