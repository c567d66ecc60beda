"""propagate_shapes: run example inputs through the graph, recording shape and dtype.

Writes ``node.meta["tensor_meta"]`` (torch.fx's ShapeProp format) for every node.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import fx
from torch.fx.passes.shape_prop import ShapeProp

__all__ = ["propagate_shapes"]


def propagate_shapes(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule:
    """Annotate ``gm`` in place with the shapes and dtypes seen on ``example_inputs``.

    Raises ValueError, naming the node and op, when the inputs do not fit the model.
    """
    prop = ShapeProp(gm)
    with torch.no_grad():
        try:
            prop.propagate(*example_inputs)
        except Exception as exc:  # ShapeProp names the node in its own message
            raise ValueError(
                f"example_inputs do not run through the model: {exc}. Pass example_inputs as a tuple of the "
                "positional arguments of forward, with shapes the model accepts"
            ) from exc
    return gm
