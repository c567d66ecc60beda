"""restore_modules: turn a functional conv, linear, batch norm or recurrent layer of an exported graph back
into a call of the module it came from, so the graph looks as torch.fx traces it.

torch.export writes ``nn.Conv2d`` as ``conv2d(x, get_attr 0.weight, get_attr 0.bias, ...)`` on a
bare ``nn.Module`` holding the parameters. Where such a holder has exactly the call's parameters
(and buffers) and nothing reads them elsewhere, it is replaced by the ``nn.Conv2d`` /
``nn.Linear`` / ``nn.BatchNorm2d`` sharing those tensors and the node becomes ``call_module``: batch
norms fold into the conv before them at convert (passes/fold_batchnorm.py folds module pairs),
and a ``QConfigMapping`` set by module type or name applies as it does to a traced model. The same for
``torch.lstm``, ``torch.gru``, ``torch.rnn_tanh``, ``torch.rnn_relu`` and their cells (``torch.lstm_cell``, ...):
``nn.LSTM`` and its kin, which convert runs in int8 (passes/lower_recurrent.py), where as calls of those
functions they ran float.

Reads and writes no ``node.meta`` key of its own; the new node keeps the old one's meta.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.nn.functional as F
from torch import fx, nn

__all__ = ["restore_modules"]

_CONVS = {F.conv1d: nn.Conv1d, F.conv2d: nn.Conv2d, F.conv3d: nn.Conv3d}
_BATCH_NORMS = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}  # by input rank


def _holder(gm: fx.GraphModule, node: fx.Node, attrs: List[Optional[fx.Node]], names: List[str]) -> Optional[str]:
    """The path of the bare module holding exactly ``attrs`` (as ``names``), read by ``node`` only."""
    present = [(a, n) for a, n in zip(attrs, names) if a is not None]
    if not present or any(not isinstance(a, fx.Node) or a.op != "get_attr" or list(a.users) != [node] for a, _ in present):
        return None
    paths = {a.target.rpartition(".")[0] for a, _ in present}
    path = paths.pop() if len(paths) == 1 else None
    if path is None or not path or any(a.target != f"{path}.{n}" for a, n in present):
        return None
    holder = gm.get_submodule(path)
    held = set(holder._parameters) | set(holder._buffers)
    if type(holder) is not nn.Module or list(holder.children()) or not {n for _, n in present} <= held:
        return None
    readers = [n for n in gm.graph.nodes if n.op == "get_attr" and n.target.startswith(path + ".")]
    return path if set(readers) == {a for a, _ in present} else None


def _conv(gm, node) -> Optional[tuple]:
    x, w, b, stride, padding, dilation, groups = (list(node.args) + [None] * 7)[:7]
    path = _holder(gm, node, [w, b], ["weight", "bias"])
    if path is None or isinstance(padding, str):
        return None
    holder = gm.get_submodule(path)
    weight = holder.weight
    module = _CONVS[node.target](weight.shape[1] * groups, weight.shape[0], tuple(weight.shape[2:]), stride, padding,
                                 dilation, groups, bias=b is not None)
    return path, module, (x,), [w, b]


def _linear(gm, node) -> Optional[tuple]:
    x, w, b = (list(node.args) + [None] * 3)[:3]
    path = _holder(gm, node, [w, b], ["weight", "bias"])
    if path is None:
        return None
    weight = gm.get_submodule(path).weight
    return path, nn.Linear(weight.shape[1], weight.shape[0], bias=b is not None), (x,), [w, b]


def _batch_norm(gm, node) -> Optional[tuple]:
    x, mean, var, w, b = (list(node.args) + [None] * 5)[:5]
    rest = dict(zip(("training", "momentum", "eps"), node.args[5:]), **node.kwargs)
    value = x.meta.get("val") if isinstance(x, fx.Node) else None
    cls = _BATCH_NORMS.get(value.dim()) if isinstance(value, torch.Tensor) else None
    path = _holder(gm, node, [mean, var, w, b], ["running_mean", "running_var", "weight", "bias"])
    if cls is None or path is None or rest.get("training") or w is None or b is None:
        return None
    holder = gm.get_submodule(path)
    module = cls(holder.running_mean.shape[0], eps=rest.get("eps", 1e-5), momentum=rest.get("momentum", 0.1))
    return path, module, (x,), [mean, var, w, b]


def _recurrent(gm, node) -> Optional[tuple]:
    """torch.lstm / torch.gru (x, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    nn.LSTM / nn.GRU / nn.RNN on the holder of params (an LSTM's weight_hr_l0, ...: its proj_size). Not a packed
    sequence's form (data, batch_sizes, hx, params, ...), nor one read otherwise than by its items."""
    if len(node.args) != 9 or not isinstance(node.args[2], (list, tuple)) or any(
            user.target is not operator.getitem for user in node.users):
        return None
    x, hx, params, bias, layers, dropout, _, both, batch_first = node.args
    kind, options = _LAYERS[node.target]
    each, directions = (4 if bias else 2), (2 if both else 1)
    projected = kind is nn.LSTM and len(params) == (each + 1) * directions * layers  # weight_hr last, torch's order
    pieces = (("weight", "ih"), ("weight", "hh"), ("bias", "ih"), ("bias", "hh"))[:each] + ((("weight", "hr"),) if projected else ())
    names = [f"{w}_{k}_l{layer}{s}" for layer in range(layers) for s in ("", "_reverse")[:directions] for w, k in pieces]
    path = _holder(gm, node, list(params), names) if len(params) == len(pieces) * directions * layers else None
    if path is None:
        return None
    holder = gm.get_submodule(path)
    size = dict(hidden_size=holder.weight_hr_l0.shape[1], proj_size=holder.weight_hr_l0.shape[0]) if projected else \
        dict(hidden_size=holder.weight_hh_l0.shape[1])
    module = kind(holder.weight_ih_l0.shape[1], num_layers=layers, bias=bias, batch_first=batch_first, dropout=dropout,
                  bidirectional=both, **size, **options)
    return path, module, (x, tuple(hx) if kind is nn.LSTM else hx), list(params)


def _cell(gm, node) -> Optional[tuple]:
    """torch.lstm_cell / torch.gru_cell / torch.rnn_tanh_cell / ... (x, hx, w_ih, w_hh, b_ih, b_hh): nn.LSTMCell / ..."""
    x, hx, *weights = (list(node.args) + [None] * 6)[:6]
    path = _holder(gm, node, weights, ["weight_ih", "weight_hh", "bias_ih", "bias_hh"])
    if path is None or (weights[2] is None) != (weights[3] is None):
        return None
    w_ih = gm.get_submodule(path).weight_ih
    kind, options = _CELLS[node.target]
    gates = {nn.LSTMCell: 4, nn.GRUCell: 3}.get(kind, 1)
    module = kind(w_ih.shape[1], w_ih.shape[0] // gates, bias=weights[2] is not None, **options)
    return path, module, (x, tuple(hx) if kind is nn.LSTMCell else hx), weights


# The function torch.export records for each layer and cell, and how to build the module back.
_TANH, _RELU = {"nonlinearity": "tanh"}, {"nonlinearity": "relu"}
_LAYERS = {torch.lstm: (nn.LSTM, {}), torch.gru: (nn.GRU, {}), torch.rnn_tanh: (nn.RNN, _TANH), torch.rnn_relu: (nn.RNN, _RELU)}
_CELLS = {torch.lstm_cell: (nn.LSTMCell, {}), torch.gru_cell: (nn.GRUCell, {}), torch.rnn_tanh_cell: (nn.RNNCell, _TANH),
          torch.rnn_relu_cell: (nn.RNNCell, _RELU)}


def _flat_items(gm: fx.Graph, node: fx.Node, call: fx.Node) -> None:
    """torch.lstm returns (output, h, c), nn.LSTM (output, (h, c)): its items 1 and 2 become call[1][0] and [1][1]."""
    for user in list(node.users):
        index = user.args[1]
        if index in (1, 2):
            with gm.inserting_before(user):
                state = gm.call_function(operator.getitem, (call, 1))
            user.args = (state, index - 1)


_RESTORERS: Dict[Any, Callable[..., Optional[tuple]]] = {
    **{fn: _conv for fn in _CONVS},  # conv2d(x, 0.weight, 0.bias) -> call_module 0 (nn.Conv2d)
    F.linear: _linear,  # linear(x, fc.weight, fc.bias) -> call_module fc (nn.Linear)
    F.batch_norm: _batch_norm,  # batch_norm(x, 1.running_mean, ...) -> call_module 1 (nn.BatchNorm2d)
    **{fn: _recurrent for fn in _LAYERS},  # lstm(x, hx, [rnn.weight_ih_l0, ...], ...) -> call_module rnn (nn.LSTM)
    **{fn: _cell for fn in _CELLS},  # gru_cell(x, h, cell.weight_ih, ...) -> call_module cell (nn.GRUCell)
}


def restore_modules(gm: fx.GraphModule) -> fx.GraphModule:
    """Give ``gm``'s functional conv/linear/batch-norm calls on their own holder their module back (in place)."""
    for node in list(gm.graph.nodes):
        restore = _RESTORERS.get(node.target) if node.op == "call_function" else None
        found = restore(gm, node) if restore is not None else None
        if found is None:
            continue
        path, module, args, attrs = found
        holder = gm.get_submodule(path)
        for name, tensor in list(holder._parameters.items()) + list(holder._buffers.items()):
            if name in module._parameters:
                module._parameters[name] = tensor
            else:
                module._buffers[name] = tensor
        if isinstance(module, nn.RNNBase):
            module._init_flat_weights()  # its forward reads its weights from this list
        module.eval()
        parent, _, attr = path.rpartition(".")
        setattr(gm.get_submodule(parent) if parent else gm, attr, module)
        with gm.graph.inserting_before(node):
            call = gm.graph.call_module(path, args)
        call.meta.update(node.meta)
        if node.target is torch.lstm:
            _flat_items(gm.graph, node, call)
        node.replace_all_uses_with(call)
        gm.graph.erase_node(node)
        for attr_node in attrs:
            if attr_node is not None:
                gm.graph.erase_node(attr_node)
    gm.recompile()
    return gm
