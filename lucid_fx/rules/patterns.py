"""Pattern rules: subgraphs written out op by op that are one canonical op, recognised and
replaced by it before observers are chosen (passes/rewrite_patterns.py), so the whole computes as
one int8 kernel instead of a chain of float ops (rsqrt, pow) no kernel takes.

A rule's ``match(end) -> Match | None`` looks at the node that would end the subgraph; a match
names the nodes it replaces and the call (function and arguments) that replaces them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx._meta import TENSOR_META
from lucid_fx._where import caller_location
from lucid_fx.node_refs import attr_value, canonical

__all__ = ["Match", "PatternRule", "PATTERN_RULES"]


@dataclass(frozen=True)
class Match:
    replaced: Tuple[fx.Node, ...]  # every node of the subgraph, its end last
    target: Callable  # the function that computes it in one call
    args: Tuple[Any, ...]
    op: str  # the canonical op of that call
    params: Tuple[str, ...]  # its parameter names, for node.meta[OP]


@dataclass(frozen=True)
class PatternRule:
    name: str
    match: Callable[[fx.Node], Optional[Match]]
    where: str


def _op(node: Any) -> Optional[str]:
    call = canonical(node) if isinstance(node, fx.Node) else None
    return call.op if call is not None else None


def _operands(node: fx.Node) -> List[Any]:
    return [node.args[0], node.args[1]] if len(node.args) == 2 and not node.kwargs else []


def _only_user(node: fx.Node, user: fx.Node) -> bool:
    return list(node.users) == [user]


def _weight(node: Any) -> Optional[torch.Tensor]:
    """A 1-D constant of the graph (``self.weight`` read with get_attr)."""
    value = attr_value(node)
    return value if isinstance(value, torch.Tensor) and value.dim() == 1 else None


def _normalized(end: fx.Node) -> Optional[Tuple[Any, fx.Node, float, List[fx.Node]]]:
    """``x * rsqrt(mean(x ** 2, -1, keepdim=True) + eps)`` ending at ``end``: (x, end, eps, nodes)."""
    if _op(end) != "mul":
        return None
    for x, scale in (_operands(end), _operands(end)[::-1]) if _operands(end) else ():
        if _op(scale) != "rsqrt" or not _only_user(scale, end):
            continue
        add = scale.args[0]
        if _op(add) != "add" or not _only_user(add, scale) or len(add.args) != 2:
            continue
        mean, eps = add.args if isinstance(add.args[0], fx.Node) else add.args[::-1]
        if _op(mean) != "mean" or not isinstance(eps, (int, float)) or not _only_user(mean, add):
            continue
        call = canonical(mean)
        if call.args.get("dim") not in (-1, [-1], (-1,)) or call.args.get("keepdim") is not True:
            continue
        square = call.args.get("input")
        if _op(square) != "pow" or not _only_user(square, mean) or list(square.args) != [x, 2]:
            continue
        return x, end, float(eps), [square, mean, add, scale, end]
    return None


def _rms_norm(end: fx.Node) -> Optional[Match]:
    """``w * (x * rsqrt(mean(x ** 2, -1, keepdim=True) + eps))``, ``w`` on either side or absent."""
    found = _normalized(end)
    weight = None
    if found is None and _op(end) == "mul" and _operands(end):
        for inner, w in (_operands(end), _operands(end)[::-1]):
            found = _normalized(inner) if isinstance(inner, fx.Node) and _only_user(inner, end) else None
            weight = w if found is not None and _weight(w) is not None else None
            if weight is not None:
                break
        found = found if weight is not None else None
    if found is None:
        return None
    x, _, eps, nodes = found
    meta = x.meta.get(TENSOR_META) if isinstance(x, fx.Node) else None
    size = _weight(weight).shape[0] if weight is not None else (meta.shape[-1] if meta is not None else None)
    if size is None or (meta is not None and meta.shape[-1] != size):
        return None
    replaced = tuple(nodes + ([end] if weight is not None else []))
    return Match(replaced, F.rms_norm, (x, (int(size),), weight, eps), "rms_norm", ("input", "normalized_shape", "weight", "eps"))


def _l2_normalized(end: fx.Node) -> Optional[Match]:
    """``x / x.norm(dim=d, keepdim=True)`` (CLIP's features): ``F.normalize(x, 2, d)``, which also keeps a zero row 0."""
    operands = _operands(end) if _op(end) == "div" else []
    if not operands or _op(operands[1]) != "norm" or not _only_user(operands[1], end):
        return None
    x, norm = operands
    call = canonical(norm)
    dim = call.args.get("dim")
    dim = dim[0] if isinstance(dim, (list, tuple)) and len(dim) == 1 else dim
    if call.args.get("input") is not x or call.args.get("p", "fro") not in (2, 2.0, "fro") or call.args.get("keepdim") is not True \
            or not isinstance(dim, int):
        return None
    return Match((norm, end), F.normalize, (x, 2.0, dim), "normalize", ("input", "p", "dim"))


def pattern(name: str, match: Callable[[fx.Node], Optional[Match]]) -> PatternRule:
    return PatternRule(name, match, caller_location())


PATTERN_RULES: List[PatternRule] = [
    # w * (x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)) -> F.rms_norm(x, (d,), w, eps): Llama's RMSNorm
    pattern("rms_norm", _rms_norm),
    # x / x.norm(dim=d, keepdim=True) -> F.normalize(x, 2, d): CLIP's image and text features
    pattern("normalize", _l2_normalized),
]
