"""FLOPs of the matrix ops of a prepared graph, from the shapes prepare recorded
(``node.meta["tensor_meta"]``), and of a float model, from torch's own counter.

Counted: linear, conv1d/2d/3d, matmul (bmm, mm), addmm, scaled_dot_product_attention, at 2 FLOPs
per multiply-add. Everything else is cheap next to them, and not counted.
"""

from __future__ import annotations

import math
from typing import Dict, Iterator, Optional, Tuple

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from lucid_fx import _meta

__all__ = ["node_flops", "graph_flops", "prepared_graphs", "model_flops"]

MATRIX_OPS = ("linear", "conv1d", "conv2d", "conv3d", "matmul", "addmm", "scaled_dot_product_attention")


def _unobserved(value):
    """The value an observer node watches (prepare puts one between a value and its users)."""
    while isinstance(value, fx.Node) and value.op == "call_module" and str(value.target).startswith("lucid_fx_"):
        value = value.args[0]
    return value


def _shape(value) -> Optional[Tuple[int, ...]]:
    value = _unobserved(value)
    if isinstance(value, fx.Node):
        meta = value.meta.get(_meta.TENSOR_META)
        return tuple(meta.shape) if hasattr(meta, "shape") else None
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return None


def _op_name(node: fx.Node) -> str:
    call = node.meta.get(_meta.OP)
    if call is not None:
        return call.op
    target = node.target
    if isinstance(target, torch._ops.OpOverload):  # an aten op, from a torch.export graph
        return {"mm": "matmul", "bmm": "matmul", "convolution": "conv2d"}.get(target.overloadpacket.__name__, target.overloadpacket.__name__)
    return getattr(target, "__name__", str(target))


def _weight(gm: fx.GraphModule, node: fx.Node) -> Optional[Tuple[int, ...]]:
    """The weight's shape: a module's parameter, or the second argument of a functional call."""
    if node.op == "call_module":
        weight = getattr(gm.get_submodule(node.target), "weight", None)
        return tuple(weight.shape) if weight is not None else None
    value = _unobserved(node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None))
    if isinstance(value, fx.Node) and value.op == "get_attr":
        return tuple(getattr_path(gm, value.target).shape)
    return _shape(value)


def getattr_path(root: nn.Module, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def node_flops(gm: fx.GraphModule, node: fx.Node) -> int:
    """FLOPs of one node of a graph that has tensor_meta; 0 for ops that are not matrix ops."""
    op = _op_name(node)
    if op not in MATRIX_OPS:
        return 0
    out = _shape(node)
    if out is None:
        return 0
    args = node.args
    if op == "linear":
        weight = _weight(gm, node)
        return 2 * math.prod(out) * weight[-1] if weight else 0
    if op.startswith("conv"):
        weight = _weight(gm, node)
        return 2 * math.prod(out) * math.prod(weight[1:]) if weight else 0
    if op == "matmul":
        first = _shape(args[0]) if node.op != "call_module" else None
        return 2 * math.prod(out) * first[-1] if first else 0
    if op == "addmm":  # addmm(bias, mat1, mat2)
        mat1 = _shape(args[1])
        return 2 * math.prod(out) * mat1[-1] if mat1 else 0
    query, key, value = (_shape(a) for a in args[:3])
    if not (query and key and value):
        return 0
    rows = math.prod(query[:-1])
    return 2 * rows * key[-2] * query[-1] + 2 * rows * key[-2] * value[-1]


def graph_flops(gm: fx.GraphModule) -> Dict[str, int]:
    """Node name -> FLOPs, for the matrix ops of ``gm``."""
    return {n.name: f for n in gm.graph.nodes if (f := node_flops(gm, n))}


def prepared_graphs(model: nn.Module, prefix: str = "") -> Iterator[Tuple[str, fx.GraphModule]]:
    """Every prepared graph in ``model`` (the root, or the traced parts of an untraceable model), by path."""
    if isinstance(model, fx.GraphModule) and hasattr(model, "lucid_fx_observers"):
        yield prefix, model
    for name, child in model.named_children():
        if name not in ("lucid_fx_observers", "lucid_fx_weight_observers"):
            yield from prepared_graphs(child, f"{prefix}.{name}" if prefix else name)


def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


# torch's table has the CUDA attention kernels only; scaled_dot_product_attention on CPU runs this one.
_CPU_KERNELS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa}


def model_flops(model: nn.Module, args: tuple, kwargs: dict) -> int:
    """Total matrix FLOPs of running ``model`` once, counted by torch at the aten level (mm, addmm,
    bmm, convolution, attention)."""
    counter = FlopCounterMode(display=False, custom_mapping=_CPU_KERNELS)
    with counter, torch.no_grad():
        model(*args, **kwargs)
    return counter.get_total_flops()
