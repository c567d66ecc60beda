"""Values whose tail a max reads: observed by their min and max, never clipped.

A HistogramObserver picks the grid that rounds most values best and clips the few largest: right for a value
read element by element, wrong for one a global max reads, which keeps exactly those largest values (PointNet's
max over points, a text CNN's max over time, a global max pool). And the point holding a feature's max got
there through the per-point layers before it (1x1 convolutions, linears, elementwise ops), so their clipped
tails are the max's inputs too. Measured over five seeds (docs/policies.md, "A max keeps its tail"): PointNet
(3 -> 64 -> 128 -> 512, max over 1024 points in [-1, 1]) 36.9 -> 42.2 dB; a text CNN, whose max reads a width-3
convolution, 41.3 -> 42.4; a convolution + global max pool head 40.9 -> 41.6.

So the value a global max (or min) reads, and what it is computed from through per-point layers, are observed
by min and max on the QConfig's grid: where the QConfig's activation observer is the default histogram and no
QConfig entry names the node (choose_observers applies :func:`keep_tails` after its other sweeps).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterator, Optional

from torch import fx

from lucid_fx.node_refs import canonical
from lucid_fx.ops import Tag, ops_tagged
from lucid_fx.quantization.histogram import HistogramObserver
from lucid_fx.quantization.observers import MinMaxObserver
from lucid_fx.quantization.qconfig import QConfig
from lucid_fx.rules.lowering_shared import global_max

__all__ = ["REDUCES_TO_EXTREMES", "PER_POINT", "reads_tail", "tail_sources", "keep_tails", "TAILS_WHY"]

#: Ops that keep only the largest (smallest) values of what they reduce.
REDUCES_TO_EXTREMES = frozenset({"amax", "amin", "max", "min"})
_POOLS = frozenset({"adaptive_max_pool1d", "adaptive_max_pool2d", "max_pool1d"})  # global ones only (global_max)
#: Ops that compute each point from the same point of their inputs (a convolution only with a 1-wide kernel).
PER_POINT = ops_tagged(Tag.ELEMENTWISE) | ops_tagged(Tag.MOVES_CODES) | {"linear", "batch_norm", "conv1d", "conv2d"}
TAILS_WHY = "min/max observed: a global max reads its largest values, which a histogram would clip"


def reads_tail(node: fx.Node) -> bool:
    """Whether ``node`` is a global max or min: of every element, over a dim, or a max pool to one value."""
    call = canonical(node)
    return call is not None and (call.op in REDUCES_TO_EXTREMES or call.op in _POOLS and global_max(node))


def _per_point(gm: fx.GraphModule, node: fx.Node) -> bool:
    call = canonical(node)
    if call is None or call.op not in PER_POINT:
        return False
    if call.op not in ("conv1d", "conv2d"):
        return True
    weight = gm.get_submodule(node.target).weight if node.op == "call_module" else None
    return weight is not None and all(k == 1 for k in weight.shape[2:])


def tail_sources(gm: fx.GraphModule, reader: fx.Node) -> Iterator[fx.Node]:
    """The value ``reader`` (a :func:`reads_tail` op) reduces, and what it is computed from through per-point ops."""
    stack, seen = list(canonical(reader).tensor_inputs()[:1]), set()
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        yield node
        if _per_point(gm, node):
            stack.extend(n for n in canonical(node).tensor_inputs() if n.op != "get_attr")


def keep_tails(qconfig: Optional[QConfig]) -> Optional[QConfig]:
    """``qconfig`` observing by min and max on its grid, where its activation observer is a histogram; else None."""
    factory = getattr(qconfig, "activation", None)
    if getattr(factory, "func", None) is not HistogramObserver:
        return None
    keywords = {k: v for k, v in factory.keywords.items() if k in ("qscheme", "qdtype", "eps")}
    return replace(qconfig, activation=MinMaxObserver.with_args(**keywords))
