"""The deep copy prepare and convert make of a user's model (they never change the model given)."""

from __future__ import annotations

import copy
import warnings

from torch import nn

__all__ = ["copy_model"]


def copy_model(model: nn.Module) -> nn.Module:
    """A deep copy. An exported graph (``ExportedProgram.module()``, or prepare's torch.export
    capture) holds torch.export's call specs, whose copy makes torch 2.13 warn about its own pytree
    internals (``LeafSpec``): nothing a user can act on, so not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
        return copy.deepcopy(model)
