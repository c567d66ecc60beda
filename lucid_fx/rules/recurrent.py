"""Recurrent layers in a prepared graph: ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells, called as modules,
run after convert as quantize_dynamic's int8 layers (lucid_fx/dynamic_rnn.py: int8 weights per gate row, each
call's input on its own range, the state on a fixed grid over [-1, 1] (a relu RNN's: each step's), float
cells), with the layer's
QConfig: its weight observer sets the weight codes, its activation dtype the input's grid. None keeps a layer
float. An int8 graph around it reads its float output as it reads any float op's.

>>> from torch import nn
>>> print(dynamic_why(nn.GRU(4, 8)))
dynamic int8 GRU: int8 weights and products, the state on [-1, 1], float cells (quantize_dynamic's layer)
"""

from __future__ import annotations

from typing import Optional

from torch import fx, nn

__all__ = ["RECURRENT_LAYERS", "recurrent_layer", "dynamic_why"]

RECURRENT_LAYERS = (nn.LSTM, nn.GRU, nn.RNN, nn.LSTMCell, nn.GRUCell, nn.RNNCell)


def recurrent_layer(gm: fx.GraphModule, node: fx.Node) -> Optional[nn.Module]:
    """The float recurrent layer ``node`` calls (exactly one of :data:`RECURRENT_LAYERS`, not a subclass,
    whose forward may differ), else None."""
    if node.op != "call_module":
        return None
    module = gm.get_submodule(str(node.target))
    if type(module) not in RECURRENT_LAYERS:
        return None
    return module


def dynamic_why(layer: nn.Module) -> str:
    """The convert report's and explain's reason for a recurrent layer run as quantize_dynamic's."""
    kind = type(layer).__name__
    unbounded = getattr(layer, "nonlinearity", "tanh") == "relu" or getattr(layer, "proj_size", 0)  # no fixed bound
    grid = "each step's grid for the state" if unbounded else "the state on [-1, 1]"
    return f"dynamic int8 {kind}: int8 weights and products, {grid}, float cells (quantize_dynamic's layer)"
