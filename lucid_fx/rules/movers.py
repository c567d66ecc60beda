"""Ops that move codes: their output is a rearrangement or subset of the input's values, on the input's grid
(the observer table shares the input's observer with them, rules/observers.py), and the tuple items that do so."""

from __future__ import annotations

from typing import Any, Optional

from lucid_fx.ops import Tag, canonical, ops_tagged

__all__ = ["SHARED_OPS", "TUPLE_MOVERS", "item_source"]

# Ops whose output is a rearrangement or subset of the input's values: keep the input's qparams.
SHARED_OPS = ops_tagged(Tag.MOVES_CODES)
# Of those, the ones that return a tuple of tensors: their items (``getitem``) share the input's qparams.
TUPLE_MOVERS = frozenset({"chunk", "split", "tensor_split", "unbind", "max", "min"})  # max/min over a dim: (values, indices)


def item_source(node) -> Optional[Any]:
    """``x`` for ``node`` = ``chunk(x, ...)[i]``, ``split(x, ...)[i]`` or ``unbind(x)[i]`` (an item of a
    tuple that moves ``x``'s values), else None."""
    call = canonical(node)
    if call is None or call.op != "getitem":
        return None
    inputs = call.tensor_inputs()
    mover = canonical(inputs[0]) if len(inputs) == 1 else None
    if mover is None or mover.op not in TUPLE_MOVERS:
        return None
    sources = mover.tensor_inputs()
    return sources[0] if len(sources) == 1 else None
