"""merge_program_linears: int8 linears that read the same codes and give float results become one GEMM.

A gated MLP's ``tanh(value(x)) * sigmoid(gate(x))`` runs two linears of one input, each with a float
result (its tail runs in float). In a program (never in the portable graph, which save, reports and the
viewer read), such siblings become one ``lucid_fx.linear`` over their weights stacked, and its result is
split into views: one pass over the input codes and one oneDNN call where there were two, with equal
results. Measured (1 thread, AVX512-VNNI EPYC, the gated MLP of benchmarks/, batch 64, width 1024): the
two linears 734 us merged against 782 as two calls (profile), the model 1177-1190 us against 1195-1198.

Siblings merge when every argument but weight, weight scale and bias is the same (input codes, their
scale and zero point, post-op, float32 result) and the weights are int8 constants of one input width.
Results that are codes stay separate: their split views would reach int8 kernels that want them dense
(a Llama MLP's gate and up give codes on two grids, so it does not merge).
"""

from __future__ import annotations

import operator
from typing import Dict, List, Optional, Tuple

import torch
from torch import fx

from lucid_fx.kernels.library import op_name

__all__ = ["merge_program_linears", "drop_unread_merged", "PREFIX"]

PREFIX = "_program_merged_"  # the stacked weights' attributes, dropped once the program's rules packed them


def _constant(program: fx.GraphModule, node) -> Optional[torch.Tensor]:
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    value = program
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value if isinstance(value, torch.Tensor) else None


def _key(program: fx.GraphModule, node: fx.Node):
    """What siblings must share (None: this linear does not merge)."""
    if op_name(node) != "linear" or node.kwargs or len(node.args) != 10:
        return None
    qx, x_scale, x_zp, qw, w_scale, bias, out_scale, out_zp, post_op, out_dtype = node.args
    weight, scales = _constant(program, qw), _constant(program, w_scale)
    if out_dtype != torch.float32 or not isinstance(qx, fx.Node) or weight is None or scales is None:
        return None
    if weight.dim() != 2 or weight.dtype != torch.int8 or scales.shape != (weight.shape[0],):
        return None
    if bias is not None and (_constant(program, bias) is None or _constant(program, bias).shape != scales.shape):
        return None
    return (qx, x_scale, x_zp, out_scale, out_zp, post_op, weight.shape[1], weight.device, bias is None)


def _stacked(program: fx.GraphModule, graph: fx.Graph, parts: List[torch.Tensor], hint: str, before: fx.Node):
    name = f"{PREFIX}{hint}_{sum(1 for key in program.__dict__ if key.startswith(PREFIX))}"
    program.__dict__[name] = torch.cat(parts).contiguous()  # a plain attribute, as program constants are
    with graph.inserting_before(before):
        return graph.create_node("get_attr", name)


def merge_program_linears(program: fx.GraphModule) -> int:
    """Merge sibling linears of ``program`` (in place; ``node.meta["val"]`` set as record_values does);
    returns how many linears were merged into others."""
    graph = program.graph
    groups: Dict[Tuple, List[fx.Node]] = {}
    for node in graph.nodes:
        key = _key(program, node)
        if key is not None:
            groups.setdefault(key, []).append(node)
    merged = 0
    for siblings in groups.values():
        if len(siblings) < 2:
            continue
        first = siblings[0]
        weights = [_constant(program, n.args[3]) for n in siblings]
        with graph.inserting_before(first):
            args = list(first.args)
            args[3] = _stacked(program, graph, weights, "weight", first)
            args[4] = _stacked(program, graph, [_constant(program, n.args[4]) for n in siblings], "wscale", first)
            if first.args[5] is not None:
                args[5] = _stacked(program, graph, [_constant(program, n.args[5]) for n in siblings], "bias", first)
            linear = graph.call_function(first.target, tuple(args))
            sizes = [w.shape[0] for w in weights]
            split = graph.call_function(torch.split_with_sizes, (linear, sizes, -1))  # torch.split's own binding
            # (torch.split is Python over it: 3.4 against 1.4 us a call)
        linear.meta = dict(first.meta)
        if "val" in first.meta:
            val = first.meta["val"]
            linear.meta["val"] = torch.empty((*val.shape[:-1], sum(sizes)), dtype=val.dtype, device="meta")
            split.meta["val"] = list(torch.split_with_sizes(linear.meta["val"], sizes, -1))
        with graph.inserting_before(first):
            items = [graph.call_function(operator.getitem, (split, i)) for i in range(len(siblings))]
        for i, (node, item) in enumerate(zip(siblings, items)):
            item.meta = {k: v for k, v in node.meta.items() if k != "val"}
            if "val" in split.meta:
                item.meta["val"] = split.meta["val"][i]
            node.replace_all_uses_with(item)
            graph.erase_node(node)
        merged += len(siblings) - 1
    return merged


def drop_unread_merged(program: fx.GraphModule) -> None:
    """Drop the stacked constants no node reads any more (a program rule packed them into its own)."""
    read = {node.target for node in program.graph.find_nodes(op="get_attr")}
    for name in [key for key in program.__dict__ if key.startswith(PREFIX) and key not in read]:
        del program.__dict__[name]
