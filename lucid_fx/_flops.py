"""FLOPs of the matrix ops, for the convert report's int8 share.

In a prepared graph they are read from the shapes prepare recorded (``node.meta["tensor_meta"]``):
linear, conv1d/2d/3d, matmul (mm, bmm), addmm, baddbmm, an einsum that stays one call, grouped products (``aten._grouped_mm``,
transformers' ``grouped_mm_fallback``: Mixtral's experts), scaled_dot_product_attention and the recurrent
functions (``torch.lstm``, ``torch.gru_cell``, ...), at 2 FLOPs per multiply-add. Everything else is cheap
next to them and not counted. Code that is not a graph (a
module the untraceable-module fallback kept float) has no recorded shapes: prepare runs the float
model once under torch's FLOP counter instead, and :func:`counting_module_flops` gives each module's
FLOPs, children included.
"""

from __future__ import annotations

import contextlib
import math
from typing import Dict, Iterator, List, Optional, Tuple

import torch
from torch import fx, nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from lucid_fx import _meta

__all__ = ["MATRIX_OPS", "node_flops", "graph_flops", "counting_module_flops"]

MATRIX_OPS = ("linear", "conv1d", "conv2d", "conv3d", "conv_transpose2d", "matmul", "addmm", "baddbmm", "scaled_dot_product_attention",
              "grouped_mm", "einsum")
# Other spellings of the same ops: aten's (a torch.export graph's targets), and the grouped products,
# which have no canonical op (each row of (T, K) times the (K, N) weight of its group: Mixtral's experts)
_ALIASES = {"mm": "matmul", "bmm": "matmul", "convolution": "conv2d", "_grouped_mm": "grouped_mm",
            "grouped_mm_fallback": "grouped_mm"}


def _unobserved(value):
    """The value an observer node watches (prepare puts one between a value and its users)."""
    while isinstance(value, fx.Node) and value.op == "call_module" and str(value.target).startswith(_meta.OBSERVERS):
        value = value.args[0]
    return value


def _shape(value) -> Optional[Tuple[int, ...]]:
    value = _unobserved(value)
    if isinstance(value, fx.Node):
        meta = value.meta.get(_meta.TENSOR_META)
        return tuple(meta.shape) if hasattr(meta, "shape") else None
    return tuple(value.shape) if isinstance(value, torch.Tensor) else None


def _op_name(node: fx.Node) -> str:
    call = node.meta.get(_meta.OP)
    if call is not None:
        name = call.op  # canonical, or the raw name of an op without one ("grouped_mm_fallback.default")
    elif isinstance(node.target, torch._ops.OpOverload):
        name = node.target.overloadpacket.__name__
    else:
        name = getattr(node.target, "__name__", str(node.target))
    return _ALIASES.get(name.split(".")[0], name)


def _attr(root: nn.Module, path: str):
    for part in path.split("."):
        root = getattr(root, part)
    return root


def _weight(gm: fx.GraphModule, node: fx.Node) -> Optional[Tuple[int, ...]]:
    """The weight's shape: a module's parameter, or the second argument of a functional call."""
    if node.op == "call_module":
        weight = getattr(gm.get_submodule(node.target), "weight", None)
        return tuple(weight.shape) if weight is not None else None
    value = _unobserved(node.kwargs.get("weight", node.args[1] if len(node.args) > 1 else None))
    if isinstance(value, fx.Node) and value.op == "get_attr":
        return tuple(_attr(gm, value.target).shape)
    return _shape(value)


def _recurrent(gm: fx.GraphModule, node: fx.Node, op: str) -> int:
    """An LSTM, GRU or RNN (torch.lstm, torch.gru_cell, ...: nn.LSTM and its kin as torch.export or a traced
    subclass records them): every position of the input (T*B rows, or a packed sequence's rows) times every
    weight matrix of the call, the hidden ones included (one step a position). A deeper layer's input is
    the layer before's output, as many rows as the first's."""
    inputs = _shape(node.args[0]) if node.args else None
    if op.endswith("_cell"):  # (input, hx, w_ih, w_hh, b_ih, b_hh): hx is a pair for an LSTM's
        weights = [a for a in node.args[2:] if isinstance(a, fx.Node)]
    else:  # (input, [batch_sizes,] hx, params, ...): params, every layer's and direction's, is the longest list
        lists = [a for a in node.args[1:] if isinstance(a, (list, tuple)) and all(isinstance(p, fx.Node) for p in a)]
        weights = max(lists, key=len) if lists else []
    shapes = [tuple(_attr(gm, w.target).shape) if w.op == "get_attr" else _shape(w) for w in weights]
    if not inputs or any(shape is None for shape in shapes):
        return 0
    return 2 * math.prod(inputs[:-1]) * sum(math.prod(shape) for shape in shapes if len(shape) == 2)


_RECURRENT = {"lstm", "gru", "rnn_tanh", "rnn_relu", "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell"}


_RECURRENT_MODULES = (nn.RNNBase, nn.RNNCellBase)  # nn.LSTM, nn.GRU, nn.RNN and their cells


def _recurrent_module(gm: fx.GraphModule, node: fx.Node) -> int:
    """A recurrent module's call, counted as its function's (:func:`_recurrent`): every weight matrix of it
    times every position of the input (a packed sequence's shape is not recorded: 0)."""
    module = gm.get_submodule(str(node.target))
    inputs = _shape(node.args[0]) if node.args else None
    weights = [p for p in module.parameters() if p.dim() == 2]
    return 2 * math.prod(inputs[:-1]) * sum(w.numel() for w in weights) if inputs else 0


def node_flops(gm: fx.GraphModule, node: fx.Node) -> int:
    """FLOPs of one node of a graph with recorded shapes; 0 for ops that are not matrix ops."""
    op = _op_name(node)
    if op in _RECURRENT:
        return _recurrent(gm, node, op)
    if node.op == "call_module" and isinstance(gm.get_submodule(str(node.target)), _RECURRENT_MODULES):
        return _recurrent_module(gm, node)
    out = _shape(node) if op in MATRIX_OPS else None
    if out is None:
        return 0
    if op == "linear" or op.startswith("conv"):
        weight = _weight(gm, node)
        if not weight:
            return 0
        if op == "conv_transpose2d":  # each input value times a (Cout / groups, kh, kw) block of the weight
            source = _shape(node.args[0]) if node.args else None
            return 2 * math.prod(source) * math.prod(weight[1:]) if source else 0
        return 2 * math.prod(out) * (weight[-1] if op == "linear" else math.prod(weight[1:]))
    if op in ("matmul", "addmm", "baddbmm", "grouped_mm"):  # (b)addmm(bias, mat1, mat2); grouped_mm(x, w, offsets)
        first = _shape(node.args[1 if op in ("addmm", "baddbmm") else 0]) if len(node.args) > 1 else None
        return 2 * math.prod(out) * first[-1] if first else 0
    if op == "einsum":
        return _einsum(node)
    query, key, value = (_shape(a) for a in node.args[:3])
    if not (query and key and value):
        return 0
    rows = math.prod(query[:-1])
    return 2 * rows * key[-2] * (query[-1] + value[-1])


def _einsum(node: fx.Node) -> int:
    """An einsum's multiplies, each a combination of its letters' indices, n - 1 of them for n operands
    (an ellipsis: not counted)."""
    operands = list(node.args[1:])
    operands = list(operands[0]) if len(operands) == 1 and isinstance(operands[0], (list, tuple)) else operands
    equation = node.args[0] if node.args and isinstance(node.args[0], str) else ""
    terms, sizes = equation.replace(" ", "").split("->")[0].split(","), {}
    shapes = [_shape(a) for a in operands]
    if "." in equation or len(terms) != len(shapes) or any(s is None or len(s) != len(t) for s, t in zip(shapes, terms)):
        return 0
    for term, shape in zip(terms, shapes):
        sizes.update(zip(term, shape))
    return 2 * (len(terms) - 1) * math.prod(sizes.values())


def graph_flops(gm: fx.GraphModule) -> Dict[str, int]:
    """Node name -> FLOPs, for the matrix ops of ``gm``."""
    return {n.name: f for n in gm.graph.nodes if (f := node_flops(gm, n))}


def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _grouped_mm(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """Each row times its group's (K, N): (S, K) x (E, K, N) -> (S, N), or batched (E, M, K) x (E, K, N);
    (M, K) x (K, N) grouped along K gives one (M, N) per group, from K products in all."""
    per_group = out_shape[0] if len(a_shape) == 2 and len(b_shape) == 2 else 1
    return 2 * math.prod(out_shape) // per_group * a_shape[-1]


def _rnn_layer(input_shape, w_ih_shape, w_hh_shape, *args, out_shape=None, **kwargs) -> int:
    """One layer and direction of nn.LSTM on the CPU (oneDNN's): each step's input and hidden state times
    their gates' weights, (G*H, I) and (G*H, H), for every one of the T*B positions."""
    return 2 * math.prod(input_shape[:-1]) * (math.prod(w_ih_shape) + math.prod(w_hh_shape))


# torch's table has the CUDA attention kernels only (scaled_dot_product_attention on CPU runs this
# one), no grouped product (Mixtral's experts under transformers: torch._grouped_mm), and not the CPU's
# LSTM layer (nn.GRU and nn.RNN decompose into matrix products it counts).
_CPU_KERNELS = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa, torch.ops.aten._grouped_mm: _grouped_mm,
                torch.ops.aten.mkldnn_rnn_layer: _rnn_layer}


@contextlib.contextmanager
def counting_module_flops(root: nn.Module) -> Iterator[Dict[str, int]]:
    """Count matrix FLOPs (torch's counter, at the aten level) while ``root`` runs inside the block:
    yields module path -> the FLOPs of its calls, its children's included (``""`` is the root).
    A module that was never called (a ModuleList) has no entry."""
    counts: Dict[str, int] = {}
    started: Dict[str, List[int]] = {}
    counter = FlopCounterMode(display=False, custom_mapping=_CPU_KERNELS)

    def before(path):
        return lambda module, args: started.setdefault(path, []).append(counter.get_total_flops())

    def after(path):
        def hook(module, args, output):
            counts[path] = counts.get(path, 0) + counter.get_total_flops() - started[path].pop()
        return hook

    hooks = []
    for path, module in root.named_modules():
        hooks += [module.register_forward_pre_hook(before(path)), module.register_forward_hook(after(path))]
    fast_path = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)  # nn.MultiheadAttention's fused kernel has no formula: 0 FLOPs
    try:
        with counter:
            yield counts
    finally:
        torch.backends.mha.set_fastpath_enabled(fast_path)
        for hook in hooks:
            hook.remove()
