"""Attention masks: which input of an op is a mask, so that it is read exactly, in float.

A mask must never be quantized. ``-inf`` has no code: an observer skips it and convert maps it
to the lowest code, so masked positions get probability (0.24-0.30 of each row's mass measured
on a 12-token attention block with padding and causal masks). A large finite negative
(``-1e9``, ``-1e4``, ``finfo.min``) stretches the grid of whatever value holds it until the
scores collapse to one code (output SQNR 12-14 dB measured). So the ops below read their mask
input in float32 exactly as the float model does, and a value computed only to become such a
mask (``(1.0 - keep) * finfo.min``) is computed in float too (see :func:`mask_only_nodes`).

``MASK_SLOTS`` maps a canonical op to the function that finds its mask input (or None).
"""

from __future__ import annotations

from typing import Callable, Dict, Optional, Set

from torch import fx

from lucid_fx import _meta
from lucid_fx.aliasing import VIEW_OPS, VIEW_SPELLINGS
from lucid_fx.ops import Tag, canonical, ops_tagged

__all__ = ["MASKED_SOFTMAX", "MASK_SLOTS", "mask_input", "scores_input", "mask_only_nodes"]

#: The fusion name of ``softmax(masked_fill(s, m, v))`` and ``softmax(s + m)`` (rules/fusions.py).
MASKED_SOFTMAX = "masked_softmax"
# Ops that make scores (products of activations and weights or of two activations); a mask chain
# through one of them is not kept float, the op keeps its own decision.
_PRODUCTS = ops_tagged(Tag.PRODUCT)  # matmul, linear, convs
_SEARCH_DEPTH = 8  # q @ k.T -> * d**-0.5 -> view -> ... : scores are a few ops below a matmul


def _from_product(node: fx.Node, depth: int = _SEARCH_DEPTH) -> bool:
    """Whether ``node`` is computed from a matmul/linear/conv within ``depth`` ops."""
    call = canonical(node)
    if call is None or node.op in ("placeholder", "get_attr"):
        return False
    if call.op in _PRODUCTS:
        return True
    return depth > 0 and any(_from_product(n, depth - 1) for n in call.tensor_inputs())


def _additive_mask(node: fx.Node) -> Optional[fx.Node]:
    """The mask of ``s + m`` in a masked softmax group: the operand that is not the scores, i.e.
    not computed from a matmul; ``other`` when both or neither are (``scores + mask``)."""
    if node.meta.get(_meta.FUSION) != MASKED_SOFTMAX:
        return None
    call = canonical(node)
    a, b = call.args.get("input"), call.args.get("other")
    if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)) or a is b:
        return None
    return a if _from_product(b) and not _from_product(a) else b


MASK_SLOTS: Dict[str, Callable[[fx.Node], Optional[fx.Node]]] = {
    "masked_fill": lambda node: canonical(node).args.get("mask"),  # s.masked_fill(m, v) -> m
    "add": _additive_mask,  # softmax(s + m), fused as masked_softmax -> m
    "scaled_dot_product_attention": lambda node: canonical(node).args.get("attn_mask"),  # sdpa(q, k, v, m) -> m
}


def mask_input(node: fx.Node) -> Optional[fx.Node]:
    """The input ``node`` reads as a mask (in float, exactly), or None."""
    call = canonical(node)
    find = MASK_SLOTS.get(call.op) if call is not None else None
    found = find(node) if find is not None else None
    return found if isinstance(found, fx.Node) else None


def scores_input(node: fx.Node) -> Optional[fx.Node]:
    """The other operand of a masked op: what it masks (``s`` of ``s.masked_fill(m, v)`` or ``s + m``)."""
    mask = mask_input(node)
    call = canonical(node)
    for name in ("input", "other"):
        value = call.args.get(name)
        if isinstance(value, fx.Node) and value is not mask:
            return value
    return None


def _reads_only_as_mask(user: fx.Node, node: fx.Node) -> bool:
    """Whether ``user`` reads ``node`` as its mask and in no other argument."""
    args = canonical(user).args.values()
    uses = sum(v is node for value in args for v in (value if isinstance(value, (list, tuple)) else (value,)))
    return mask_input(user) is node and uses == 1


def _unused_write(user: fx.Node) -> bool:
    """An in-place op that stayed in place (passes/functionalize_inplace.py) and whose result nothing reads:
    what it does is change its first argument (``view.copy_(view.masked_fill(pad, min))``)."""
    return _meta.MUTATION in user.meta and not user.users and bool(user.args) and isinstance(user.args[0], fx.Node)


def _storage(node: fx.Node) -> fx.Node:
    """The value whose storage ``node`` views (``node`` itself when it is no view)."""
    while True:
        call = canonical(node)
        source = call.tensor_inputs()[0] if call is not None and call.tensor_inputs() else None
        if call is None or source is None or not (call.op in VIEW_OPS or call.spelling in VIEW_SPELLINGS):
            return node
        node = source


def mask_only_nodes(graph: fx.Graph) -> Set[fx.Node]:
    """The nodes whose value reaches nothing but mask inputs: ``(1.0 - keep) * -1e4`` and what
    it is built from, up to the graph inputs. They are computed in float; a matmul, linear or
    conv among them keeps its own decision.

    A write in place that nothing reads (transformers' causal mask, as torch.export captures it:
    the padding mask copied into a view of a clone) is mask-only when the storage it writes into
    is; its operands then are when their other uses are. Such writes close loops (the view is read
    by what is copied back into it), so this starts from every candidate and takes away, until
    nothing changes, each one with a use that is neither mask-only nor a read as a mask."""
    found: Set[fx.Node] = set()
    for node in graph.nodes:
        call = canonical(node)
        if call is not None and node.op not in ("placeholder", "get_attr", "output") and call.op not in _PRODUCTS:
            found.add(node)
    changed = True
    while changed:
        changed = False
        for node in reversed(graph.nodes):
            if node in found and not _mask_only(node, found):
                found.discard(node)
                changed = True
    return found


def _mask_only(node: fx.Node, found: Set[fx.Node]) -> bool:
    if not node.users:
        return _unused_write(node) and _storage(node.args[0]) in found
    return all(user in found or (_meta.OP in user.meta and _reads_only_as_mask(user, node)) for user in node.users)
