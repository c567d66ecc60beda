"""One name, two ops: spellings whose canonical op depends on their arguments, as data.

``torch.max(x)`` is a max over every element, ``torch.max(x, 1)`` a ``(values, indices)`` pair over a dim,
``torch.max(a, b)`` the elementwise maximum; ``x.mT`` is a transpose where ``x.shape`` is a shape. The op
table (lucid_fx/ops.py) maps a spelling to one op; :data:`OVERLOADS` then says, for the ops spelled that way,
which op the call is, from its canonical arguments (canonicalize_ops applies it, once, before any rule reads
the op). A function returns ``(op, arguments)`` or None to keep the spelled op.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

from torch import fx
from torch.fx.passes.shape_prop import TensorMetadata

from lucid_fx._meta import TENSOR_META

__all__ = ["OVERLOADS", "overloaded"]

Overload = Callable[[Dict[str, Any]], Optional[Tuple[str, Dict[str, Any]]]]


def _is_tensor(value: Any) -> bool:
    """Whether ``value`` is a node whose recorded value is a tensor (not a number the graph computed)."""
    return isinstance(value, fx.Node) and isinstance(value.meta.get(TENSOR_META), TensorMetadata)


def _ndim(value: Any) -> Optional[int]:
    meta = value.meta.get(TENSOR_META) if isinstance(value, fx.Node) else None
    return len(meta.shape) if isinstance(meta, TensorMetadata) else None


def _reduction(elementwise: str, everything: str) -> Overload:
    """torch.max/min: of two tensors -> ``elementwise``; of every element -> ``everything`` (amax over all
    dims); over a dim -> kept as the (values, indices) pair it is."""
    def resolve(args: Dict[str, Any]) -> Optional[Tuple[str, Dict[str, Any]]]:
        dim = args.get("dim", args.get("other"))
        if _is_tensor(dim):
            return elementwise, {"input": args["input"], "other": dim}
        if dim is None and "keepdim" not in args:
            return everything, {"input": args["input"], "dim": (), "keepdim": False}
        return None
    return resolve


def _attribute(args: Dict[str, Any]) -> Optional[Tuple[str, Dict[str, Any]]]:
    """``x.mT`` (and ``x.T`` of a matrix) -> transpose; ``pair.values``/``pair.indices`` of torch.max(x, dim),
    topk, sort -> its item."""
    name, x = args.get("name"), args.get("input")
    if name == "mT" or name == "T" and _ndim(x) == 2:
        return "transpose", {"input": x, "dim0": -2, "dim1": -1}
    if name in ("values", "indices") and not _is_tensor(x):
        return "getitem", {"input": x, "index": 0 if name == "values" else 1}
    return None


#: spelled op -> what the call is, by its arguments
OVERLOADS: Dict[str, Overload] = {
    "max": _reduction("maximum", "amax"),  # torch.max(a, b) / torch.max(x) / torch.max(x, dim)
    "min": _reduction("minimum", "amin"),
    "getattr": _attribute,  # x.mT, x.T, torch.max(x, 1).values
}


def overloaded(op: str, args: Dict[str, Any]) -> Tuple[str, Dict[str, Any]]:
    """The op a call spelled as ``op`` with canonical ``args`` is, and its arguments as that op names them."""
    resolve = OVERLOADS.get(op)
    found = resolve(args) if resolve is not None else None
    return found if found is not None else (op, args)
