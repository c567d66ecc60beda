"""lower_recurrent: the recurrent layers lower_to_int8 left as float modules (nn.LSTM, nn.GRU, their cells)
become quantize_dynamic's int8 layers, each with the QConfig prepare recorded for it.

Reads ``node.meta[DYNAMIC]`` (the layer's QConfig, choose_observers; absent where it is None: the layer stays
float) on the converted graph's module calls; replaces the called module by ``build(layer, qconfig)`` (the
verbs' builder: lucid_fx/dynamic_rnn.py, on convert's Target) and writes the node's ``[PLACEMENT]`` and the
report's: an int8 kernel, with lucid_fx/rules/recurrent.py's reason. The graph is unchanged: the new layer
takes and returns what the float one did, float in, float out, so the int8 values around it are quantized and
dequantized at its boundary as around any float op.
"""

from __future__ import annotations

from typing import Callable, Optional

from torch import fx, nn

from lucid_fx import _meta
from lucid_fx._placement import ConvertReport, Placement, Runs
from lucid_fx.quantization.qconfig import QConfig
from lucid_fx.rules.recurrent import dynamic_why, recurrent_layer

__all__ = ["lower_recurrent"]


def lower_recurrent(gm: fx.GraphModule, report: Optional[ConvertReport],
                    build: Callable[[nn.Module, QConfig], nn.Module]) -> fx.GraphModule:
    """Swap every recurrent layer ``gm`` calls that carries ``node.meta[DYNAMIC]`` for ``build``'s int8 layer (in place)."""
    swapped = {}  # target -> the float layer: a cell called once a step is one module, swapped once
    for node in gm.graph.nodes:
        qconfig = node.meta.get(_meta.DYNAMIC)
        layer = swapped.get(node.target) or (recurrent_layer(gm, node) if qconfig is not None else None)
        if layer is None:
            continue
        if node.target not in swapped:
            parent, _, name = str(node.target).rpartition(".")
            setattr(gm.get_submodule(parent), name, build(layer, qconfig))
            swapped[node.target] = layer
        source = node.meta.get(_meta.SOURCE, node.name)
        node.meta[_meta.PLACEMENT] = placement = Placement(Runs.KERNEL, dynamic_why(layer), (source,))
        if report is not None:
            report.placements[source] = placement
    return gm
