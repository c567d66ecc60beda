"""compare: where a quantized model loses accuracy, node by node.

The float model is traced the way prepare traced it (``gm.meta[TRACE]``: its leaf modules,
concrete_args and leaf functions), both models run on the same inputs, and every node of the
quantized graph that computes the value of a float node (``node.meta[SOURCE]``, written by convert)
is compared with it: SQNR and the largest absolute error, worst first. Integer codes are
dequantized with the grid they carry (``node.meta[QPARAMS]``). Where each node ran comes from
:func:`lucid_fx.placement.placements`, as in every other report.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx, nn
from torch.utils._pytree import tree_flatten

from lucid_fx import _meta
from lucid_fx.graph_model import _graph_modules, _op_name
from lucid_fx.ops import canonical
from lucid_fx._capture import export_like_prepare
from lucid_fx._compare_hints import channel_ranges, spread, spread_hints
from lucid_fx._compare_runs import Recorder, batches_of, capture_calls, run_recorded
from lucid_fx.passes.trace_model import TraceOptions, trace_model
from lucid_fx.placement import INT8_RUNS, Placement, placements
from lucid_fx.rules.observers import DecisionKind

__all__ = ["compare", "Comparison", "NodeError"]


@dataclass(frozen=True)
class NodeError:
    """The error of one node's quantized value against its float value, over all batches."""

    node: str  # the float graph's node name (qualified with the submodule path for nested graphs)
    measured: str  # the quantized graph's node whose output was measured
    op: str
    domain: str  # "int8" or "fixed" (integer codes on a calibrated or fixed grid) or "float" (ran in float)
    sqnr_db: float  # 10*log10(sum f^2 / sum (f - q)^2); inf when exact
    max_abs: float
    scale: Optional[float]  # the grid step of the quantized value, when it is integer codes
    numel: int
    runs: str = ""  # where the node ran (a lucid_fx.placement.Runs value; "" for graph inputs)
    channel_spread: Optional[float] = None  # integer codes: the largest channel's range over the median channel's
    spread_of: str = ""  # the op whose output channels those are (a fused conv2d+relu's conv2d; _compare_hints.py)

    @property
    def max_steps(self) -> Optional[float]:
        """The largest error in grid steps (None for float values)."""
        return self.max_abs / self.scale if self.scale else None


@dataclass
class Comparison:
    """Per-node errors, worst (lowest SQNR) first, and the SQNR of the model output."""

    rows: List[NodeError]
    output_sqnr_db: float
    batches: int

    def by_node(self) -> Dict[str, NodeError]:
        return {row.node: row for row in self.rows}

    def worst(self, n: int = 5) -> List[NodeError]:
        return self.rows[:n]

    def __str__(self) -> str:
        return self.table()

    def hints(self, limit: int = 5) -> List[str]:
        """What to try (lucid_fx/_compare_hints.py): where the model's output is below ``HINT_BELOW_DB``, a line per
        remedy naming the integer-coded layer outputs whose channels' ranges spread widest (at most ``limit``)."""
        return spread_hints(self.rows, self.output_sqnr_db, limit)

    def table(self, limit: Optional[int] = None) -> str:
        """The rows as aligned text, the worst ``limit`` of them (all by default)."""
        shown = self.rows if limit is None else self.rows[:limit]
        header = ("node", "op", "domain", "SQNR dB", "max |err|", "steps")
        table = [header] + [
            (
                r.node,
                r.op,
                r.domain,
                f"{r.sqnr_db:.1f}",
                f"{r.max_abs:.4g}",
                f"{r.max_steps:.1f}" if r.max_steps is not None else "-",
            )
            for r in shown
        ]
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) for row in table]
        if len(shown) < len(self.rows):
            lines.append(f"... {len(self.rows) - len(shown)} more node(s)")
        lines.append(f"model output: {self.output_sqnr_db:.1f} dB SQNR over {self.batches} batch(es)")
        lines += ["hint: " + hint for hint in self.hints()]
        return "\n".join(lines)


def _measured_nodes(gm: fx.GraphModule) -> Dict[str, Tuple[fx.Node, Optional[Tuple[float, int]]]]:
    """For each float-node name, the quantized-graph node holding its value and its grid (if codes).

    The integer codes a node was given are preferred over a float copy of the same value; a float
    copy is the node convert copied from the prepared graph (it carries the canonical op)."""
    chosen: Dict[str, Tuple[fx.Node, Optional[Tuple[float, int]]]] = {}
    for node in gm.graph.nodes:
        source = node.meta.get(_meta.SOURCE)
        if source is None or node.op in ("placeholder", "output", "get_attr"):
            continue
        if _meta.QPARAMS in node.meta:
            if source not in chosen or chosen[source][1] is None:
                scale, zero_point, _ = node.meta[_meta.QPARAMS]
                chosen[source] = (node, (scale, zero_point))
        elif source not in chosen and (node.name == source or _meta.OP in node.meta):  # ran in float
            chosen[source] = (node, None)
    return chosen


def _source_ops(gm: fx.GraphModule) -> Dict[str, str]:
    """The canonical op of each float node, from any converted node that carries it."""
    ops: Dict[str, str] = {}
    for node in gm.graph.nodes:
        call, source = canonical(node), node.meta.get(_meta.SOURCE, node.name)
        if call is not None:  # a reference graph keeps the float nodes' names
            ops.setdefault(source, call.op)
    return ops


def _domain(node: fx.Node, grid: Optional[Tuple[float, int]], placement: Optional[Placement]) -> str:
    # A kernel that gives its float result (passes/fold_dequantize.py) has no grid but ran in int8.
    if placement is not None and placement.runs not in INT8_RUNS or (grid is None and placement is None):
        return "float"
    decision = node.meta.get(_meta.DECISION)
    fixed = (decision is not None and decision.kind is DecisionKind.FIXED) or node.meta.get(_meta.OBSERVER_KIND) == "FixedQParamsObserver"
    return "fixed" if fixed else "int8"


def _sqnr(signal: float, noise: float) -> float:
    if noise == 0:
        return math.inf
    if signal == 0:
        return -math.inf
    return 10 * math.log10(signal / noise)


def _float_tensors(value: Any) -> List[torch.Tensor]:
    leaves, _ = tree_flatten(value)
    return [t.detach().float() for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


def compare(float_model: nn.Module, quantized_model: nn.Module, inputs: Any) -> Comparison:
    """Per-node SQNR and max-abs error of ``quantized_model`` (convert's or a reference model)
    against ``float_model`` on ``inputs`` (a tensor, a tuple of positional arguments, a dict of
    keyword arguments, or a list of those for several batches), worst first.

    >>> import torch, lucid_fx
    >>> torch.manual_seed(0) and None
    >>> m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
    >>> data = [torch.randn(16, 8) for _ in range(4)]
    >>> q = lucid_fx.quantize(m, (data[0],), data, progress=False)
    >>> result = lucid_fx.compare(m, q, data)
    >>> sorted((row.node, row.domain) for row in result.rows)  # result.rows is worst first
    [('_1', 'int8'), ('_2', 'int8'), ('input_1', 'int8')]
    >>> all(row.sqnr_db > 30 for row in result.rows), result.output_sqnr_db > 30
    (True, True)
    """
    for what, model in (("float_model", float_model), ("quantized_model", quantized_model)):
        if not isinstance(model, nn.Module):
            raise TypeError(f"compare: {what} must be an nn.Module, got {type(model).__name__}")
    parts = list(_graph_modules(quantized_model))
    if not parts:
        raise ValueError(
            "compare: quantized_model holds no torch.fx GraphModule; pass the result of lucid_fx.convert or quantize"
        )
    floats: Dict[str, fx.GraphModule] = {}
    for path, gm in parts:
        float_sub = float_model.get_submodule(path) if path else float_model
        how = gm.meta.get(_meta.TRACE, TraceOptions())
        if how.capture == "export":
            floats[path] = None  # exported on the inputs it receives in the first batch, below
            continue
        leaves = [n.target for n in gm.graph.nodes if n.op == "call_module" and isinstance(n.target, str)]
        leaves = [t for t in leaves if _has_submodule(float_sub, t)] + list(how.leaf_modules)
        traced = trace_model(
            float_sub, leaf_modules=leaves, concrete_args=how.concrete_args, autowrap_functions=how.autowrap_functions
        ).graph_module
        if traced is None:
            raise ValueError(
                f"compare: cannot trace the float module at {path or '<root>'!r} the way prepare did (a model "
                "loaded from a file no longer knows prepare's leaf_modules and concrete_args); compare the "
                "model that convert returned"
            )
        floats[path] = traced
    totals: Dict[str, List[float]] = {}
    channels: Dict[str, torch.Tensor] = {}  # integer-coded layer outputs' largest magnitude a channel, over the batches
    spreads_of: Dict[str, str] = {}
    meta: Dict[str, Tuple[str, str, str, Optional[float], str]] = {}
    out_signal = out_noise = 0.0
    expected = 0  # values quantized_model computes, over the batches
    batches = batches_of(inputs)
    paths = [path for path, _ in parts]
    placed = placements(quantized_model)
    for args, kwargs in batches:
        try:
            float_out, float_args = capture_calls(float_model, paths, args, kwargs)
        except AttributeError as exc:  # a float model of another structure (a submodule quantized_model names)
            raise ValueError(f"compare: float_model is not the model quantized_model was made from ({exc}); pass "
                             "the float model that was prepared") from exc
        quant_out, quant_args = capture_calls(quantized_model, paths, args, kwargs)
        for f, q in zip(_float_tensors(float_out), _float_tensors(quant_out)):
            out_signal += float((f * f).sum())
            out_noise += float(((f - q) ** 2).sum())
        for path, gm in parts:
            if path not in float_args or path not in quant_args:
                continue  # this part did not run on these inputs
            measured = _measured_nodes(gm)
            expected += len(measured)
            ops = _source_ops(gm)
            if floats[path] is None:
                floats[path] = export_like_prepare(float_model.get_submodule(path) if path else float_model, *float_args[path])
            f_nodes = {n.name: n for n in floats[path].graph.nodes}
            f_run = Recorder(floats[path], measured)
            q_run = Recorder(gm, {node.name: name for name, (node, _) in measured.items()})
            with torch.no_grad():
                run_recorded(f_run, floats[path], *float_args[path])
                run_recorded(q_run, gm, *quant_args[path])
            for name, (node, grid) in measured.items():
                f_val, q_val = f_run.values.get(name), q_run.values.get(node.name)
                if f_val is None or q_val is None or f_val.shape != q_val.shape or not f_val.is_floating_point():
                    continue
                q_float = (q_val.float() - grid[1]) * grid[0] if grid is not None else q_val.float()
                diff = f_val.float() - q_float
                key = f"{path}.{name}" if path else name
                acc = totals.setdefault(key, [0.0, 0.0, 0.0, 0])
                acc[0] += float((f_val.float() ** 2).sum())
                acc[1] += float((diff * diff).sum())
                acc[2] = max(acc[2], float(diff.abs().max())) if diff.numel() else acc[2]
                acc[3] += diff.numel()
                measured_name = f"{path}.{node.name}" if path else node.name
                op = ops.get(name) or _op_name(f_nodes[name]) if name in f_nodes else str(node.target)
                where = placed.get(key)
                spread_of, most = channel_ranges(op, where, f_val) if grid is not None else ("", None)
                if most is not None:
                    channels[key] = most if key not in channels else torch.maximum(channels[key], most)
                    spreads_of[key] = spread_of
                runs = where.runs.value if where is not None else ""
                meta[key] = (measured_name, op, _domain(node, grid, where), grid[0] if grid is not None else None, runs)
    if expected and not totals:
        raise ValueError("compare: float_model is not the model quantized_model was made from: none of the "
                         f"{expected // len(batches)} values quantized_model computes has a node of its name in "
                         "float_model's graph; pass the float model that was prepared")
    rows = [
        NodeError(key, meta[key][0], meta[key][1], meta[key][2], _sqnr(s, n), m, meta[key][3], int(c), meta[key][4],
                  spread(channels.get(key)), spreads_of.get(key, ""))
        for key, (s, n, m, c) in totals.items()
    ]
    rows.sort(key=lambda r: (r.sqnr_db, -r.max_abs))
    return Comparison(rows, _sqnr(out_signal, out_noise), len(batches))


def _has_submodule(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True
