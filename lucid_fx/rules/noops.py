"""No-op rules: nodes that return their input unchanged in an eval-mode model, removed before any
observer is chosen (passes/remove_noops.py), so that nothing is observed, rounded or kept float for
them. A rule maps a canonical op to ``test(node, call, module) -> reason | None``: the reason the
node is a no-op, or ``None`` when it is not (then it stays). The node's ``input`` replaces it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import torch
from torch import fx, nn

from lucid_fx._meta import TENSOR_META

__all__ = ["NOOP_RULES", "CASTS"]

Test = Callable[[fx.Node, Any, Optional[nn.Module]], Optional[str]]


def _dtype(node: Any) -> Optional[torch.dtype]:
    meta = node.meta.get(TENSOR_META) if isinstance(node, fx.Node) else None
    return getattr(meta, "dtype", None)


def _layout(node: Any) -> Optional[torch.memory_format]:
    meta = node.meta.get(TENSOR_META) if isinstance(node, fx.Node) else None
    return getattr(meta, "memory_format", None)


def _device(node: Any) -> Optional[torch.device]:
    """The device torch.export recorded for ``node`` (None for a graph torch.fx traced)."""
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return getattr(value, "device", None) if isinstance(value, torch.Tensor) else None


def _same_dtype_cast(node, call, module) -> Optional[str]:
    """x.to(x.dtype), x.float() on float32, x.type_as(y) of y's dtype: the dtypes recorded by
    propagate_shapes agree. A device (but the one torch.export recorded the input on), a memory
    format or copy=True is a real change, so it stays."""
    source = call.args.get("input")
    before, after = _dtype(source), _dtype(node)
    if before is None or before != after:
        return None
    for a in node.args[1:]:
        if isinstance(a, (str, torch.device)) and (_device(source) is None or torch.device(a) != _device(source)):
            return None
        if isinstance(a, torch.memory_format):
            return None
    if set(node.kwargs) - {"dtype", "non_blocking", "copy"} or node.kwargs.get("copy"):
        return None
    return f"cast to {str(after).removeprefix('torch.')}, which it already is"


def _eval_dropout(node, call, module) -> Optional[str]:
    training = module.training if module is not None else call.args.get("training", node.op != "call_function")
    p = getattr(module, "p", call.args.get("p", 0.5))
    if training is False or p == 0:
        return "dropout in eval mode (or p=0) returns its input"
    return None


def _eval_stochastic_depth(node, call, module) -> Optional[str]:
    """torchvision.ops.stochastic_depth(input, p, mode, training) and its module StochasticDepth
    (traced through, it is a call of the function with ``training=self.training``)."""
    if module is not None:
        training, p = module.training, getattr(module, "p", None)
    else:
        values = dict(zip(("input", "p", "mode", "training"), node.args), **node.kwargs)
        training, p = values.get("training", True), values.get("p")
    if training is False or p == 0:
        return "stochastic depth in eval mode (or p=0) returns its input"
    return None


def _contiguous(node, call, module) -> Optional[str]:
    """x.contiguous() on a tensor already contiguous (as propagate_shapes saw it); on any other it
    copies, and a later x.view() may depend on that copy, so it stays."""
    if call.args.get("memory_format", torch.contiguous_format) is not torch.contiguous_format:
        return None
    if _layout(call.args.get("input")) is torch.contiguous_format:
        return "contiguous() of a contiguous tensor returns it"
    return None


# Casts by their canonical names (method and function spellings are not in the op table).
CASTS = ("to", "type", "type_as", "float")

NOOP_RULES: Dict[str, Test] = {
    **{cast: _same_dtype_cast for cast in CASTS},  # x.to(x.dtype), x.float() on float32 -> x
    "dropout": _eval_dropout,  # F.dropout(x, training=False), nn.Dropout in eval -> x
    "stochastic_depth": _eval_stochastic_depth,  # torchvision's, in eval -> x
    "StochasticDepth": _eval_stochastic_depth,  # its module kept as a leaf, in eval -> x
    "identity": lambda node, call, module: "nn.Identity returns its input",  # nn.Identity()(x) -> x
    "contiguous": _contiguous,  # x.contiguous() on a contiguous x -> x
}
