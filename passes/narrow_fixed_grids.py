"""narrow_fixed_grids: a fixed grid shrinks to what its input's calibrated grid can give it.

A proven interval is an upper bound, and its fixed grid is right when the values fill it: a
sigmoid of scores, a softmax, a tanh that saturates. Gemma 2's soft-capping, ``tanh(x / 50) * 50``
on attention scores and ``tanh(x / 30) * 30`` on the logits, keeps its values within a few hundredths
of 0 while the proofs give ``[-1, 1]`` for the tanh and ``[-50, 50]`` for the product: every value
fell in one or two of 256 codes, and the model's output measured 7.4 dB SQNR.

An elementwise op runs as a table of its input's codes, so after calibration the values it can
output are known exactly: those of its input's grid, mapped through it. This pass, the first of
convert, walks the graph in order with the interval of every observed value (its grid's range),
maps each fixed-grid elementwise op's inputs' intervals through the op's range rule
(rules/ranges.py), and gives the fixed grid that interval instead wherever it is at most a quarter
of it (two bits or more). Only grids count as inputs: a value computed in float from a value that
itself ran in float is not bounded by any grid. Nothing that the fixed grid held is clipped: the
narrower grid holds every value the int8 model can compute there. The node's decision says so (explain, the viewer).

Reads ``node.meta[OP]``, ``[OBSERVER]``, ``[DECISION]``; replaces the observers it narrows (convert
works on a copy) and rewrites ``[DECISION]`` and ``[INTERVAL]`` of the nodes they watch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

from torch import fx

from lucid_fx import _meta
from lucid_fx import interval as I
from lucid_fx.ops import Tag, canonical, ops_tagged
from lucid_fx.quantization.fixed_qparams import FixedQParamsObserver
from lucid_fx.registry import Registry
from lucid_fx.rules.observers import DecisionKind

__all__ = ["narrow_fixed_grids", "NARROWING"]

#: A fixed grid narrows where its input can reach at most this share of it.
NARROWING = 0.25
_TABLES = ops_tagged(Tag.ELEMENTWISE)  # one value out per value in: a table of the input's codes


def _grid(observer: Any) -> Optional[Tuple[float, float]]:
    """The real interval ``observer``'s codes span (None: not one per-tensor grid)."""
    try:
        scale, zero_point = observer.calculate_qparams()
    except Exception:  # noqa: BLE001 - an observer that cannot say (a placeholder, nothing calibrated): no interval
        return None
    if scale.numel() != 1 or zero_point.numel() != 1:
        return None
    qdtype = observer.qdtype
    return float(scale) * (qdtype.quant_min - int(zero_point)), float(scale) * (qdtype.quant_max - int(zero_point))


def _reach(node: fx.Node, intervals: Dict[fx.Node, Tuple[float, float]], registry: Registry) -> Optional[Tuple[float, float]]:
    """The interval ``node``'s elementwise op maps its inputs' intervals to, or None."""
    call = canonical(node)
    rule = registry.range_rules.get(call.op) if call is not None and call.op in _TABLES else None
    if rule is None:
        return None

    def interval_of(name: str):
        value = call.args.get(name)
        if isinstance(value, fx.Node):
            return intervals.get(value)
        return I.point(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    result = rule.fn(interval_of, call)
    return (float(result[0]), float(result[1])) if I.is_bounded(result) and result[1] > result[0] else None


def narrow_fixed_grids(gm: fx.GraphModule, registry: Registry) -> fx.GraphModule:
    """Narrow ``gm``'s fixed grids (in place) to what their inputs' grids reach; see the module docstring."""
    observers = getattr(gm, _meta.OBSERVERS, None)
    if observers is None:
        return gm
    intervals: Dict[fx.Node, Tuple[float, float]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target).startswith(_meta.OBSERVERS + "."):  # what consumers read
            grid = _grid(observers[node.target.split(".", 1)[1]])
            if grid is not None:
                intervals[node] = grid
            continue
        key = node.meta.get(_meta.OBSERVER)
        if key is None or key not in observers:
            continue  # no grid: a float value may leave any interval its inputs' grids would give it
        reach = _reach(node, intervals, registry)
        observer, decision = observers[key], node.meta.get(_meta.DECISION)
        fixed = type(observer) is FixedQParamsObserver and decision is not None and decision.kind == DecisionKind.FIXED
        grid = _grid(observer)
        if fixed and reach is not None and grid is not None:
            if reach[1] - reach[0] <= NARROWING * (grid[1] - grid[0]):
                observers[key] = FixedQParamsObserver.for_interval(*reach, qdtype=observer.qdtype)
                node.meta[_meta.INTERVAL] = reach
                node.meta[_meta.DECISION] = replace(
                    decision, interval=reach,
                    reason=f"{decision.reason}; grid narrowed to [{reach[0]:.4g}, {reach[1]:.4g}], all its input's "
                           "calibrated grid can reach (passes/narrow_fixed_grids.py)")
        grid = _grid(observers[key])
        if grid is not None:
            intervals[node] = grid
    return gm
