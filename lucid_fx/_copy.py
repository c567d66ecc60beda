"""The deep copy prepare and convert make of a user's model (they never change the model given), and the
buffers prepare puts back after its own runs of it."""

from __future__ import annotations

import copy
import warnings
from typing import Dict

import torch
from torch import nn

__all__ = ["copy_model", "buffer_values", "restore_buffers"]


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy. An exported graph (``ExportedProgram.module()``, or prepare's torch.export
    capture) holds torch.export's call specs, whose copy makes torch 2.13 warn about its own pytree
    internals (``LeafSpec``): nothing a user can act on, so not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
        return copy.deepcopy(model)


def buffer_values(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every buffer's value by qualified name, copied."""
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


def restore_buffers(model: nn.Module, values: Dict[str, torch.Tensor]) -> None:
    """Put back ``values`` in the buffers of ``model`` of the same name, shape and dtype: prepare runs the model (shapes,
    FLOPs, torch.export), and a forward that updates its state (a running scale, a cache) would start calibration
    ahead of the model it came from."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            value = values.get(name)
            if value is not None and value.shape == buffer.shape and value.dtype == buffer.dtype and not torch.equal(value, buffer):
                buffer.copy_(value)
