"""analyze_ranges: interval propagation that proves which outputs are bounded.

Reads ``node.meta[OP]``; writes ``node.meta[INTERVAL]`` = ``(lo, hi)`` and
``node.meta[INTERVAL_RULE]`` (where the rule that proved it is defined) on every node whose
output is provably inside a finite interval. ``(tanh(x) + 1) / 2`` is proven in [0, 1] because
tanh is, and add and div with constants map intervals to intervals.
"""

from __future__ import annotations

from typing import Any

from torch import fx

from lucid_fx import _meta
from lucid_fx import interval as I
from lucid_fx.ops import canonical
from lucid_fx.registry import Registry

__all__ = ["analyze_ranges"]


def _interval_of(value: Any):
    if isinstance(value, fx.Node):
        return value.meta.get(_meta.INTERVAL)
    if isinstance(value, (list, tuple)):
        return [_interval_of(v) for v in value]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return I.point(value)
    return None


def analyze_ranges(gm: fx.GraphModule, registry: Registry) -> fx.GraphModule:
    """Annotate ``gm`` in place with proven output intervals."""
    for node in gm.graph.nodes:
        call = canonical(node)
        rule = registry.range_rules.get(call.op) if call is not None else None
        if rule is None:
            continue
        result = rule.fn(lambda name: _interval_of(call.args.get(name)), call)
        if I.is_bounded(result) and result[1] > result[0]:
            node.meta[_meta.INTERVAL] = (float(result[0]), float(result[1]))
            node.meta[_meta.INTERVAL_RULE] = rule.where
    return gm
