"""explain: which rule chose which observer for each node, why, and where convert will run it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from torch import fx, nn

from lucid_fx import _meta
from lucid_fx._convert_report import graph_facts, model_report
from lucid_fx._meta import OBSERVERS
from lucid_fx._placement import ConvertReport
from lucid_fx.ops import canonical
from lucid_fx.passes.lower_to_int8 import lowering_table
from lucid_fx.passes.predict_placement import predict_placement
from lucid_fx.placement import placements
from lucid_fx._prepared_registry import registry_of
from lucid_fx.registry import current_registry
from lucid_fx.rules.observers import DecisionKind

__all__ = ["explain", "Explanation"]

_COLUMNS = ("node", "op", "spelling", "kind", "observer", "qparams", "runs", "rule", "reason")


@dataclass
class Explanation:
    """Rows of (node, canonical op, spelling, decision, observer, qparams/interval, where it will
    run (``runs``, and ``runs_why``: the lowering rule or why it stays float), rule, reason), and
    ``measured``: the region kind of a candidate of ``quantize(..., precision="measured")``, else "". The
    table says where each node runs with the default ``precision="int8"``; a candidate's ``runs`` cell adds
    ``[precision='measured' may run it float: attention region]``, what that option would time."""

    rows: List[Dict[str, str]]
    report: str = ""

    def by_node(self) -> Dict[str, Dict[str, str]]:
        return {row["node"]: row for row in self.rows}

    def __str__(self) -> str:
        def cell(r, c):
            if c != "runs" or not r["runs"]:
                return r[c]
            # A prediction, not a choice: prepare tags the candidates whatever quantize's precision will be, and
            # only precision="measured" times them (the default, "int8", runs them as the row says).
            measured = f" [precision='measured' may run it float: {r['measured']} region]" if r.get("measured") else ""
            return f"{r['runs']} ({r['runs_why']}){measured}"

        widths = {c: max([len(c)] + [len(cell(r, c)) for r in self.rows]) for c in _COLUMNS if c != "reason"}
        lines = ["  ".join(c.ljust(widths[c]) for c in widths) + "  reason"]
        for r in self.rows:
            lines.append("  ".join(cell(r, c).ljust(widths[c]) for c in widths) + "  " + r["reason"])
        if self.report:
            lines.append(self.report)
        return "\n".join(lines)

    def summary(self) -> str:
        counts: Dict[str, int] = {}
        for r in self.rows:
            counts[r["kind"]] = counts.get(r["kind"], 0) + 1
        return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items()))


def _qparams_text(observer, decision) -> str:
    if decision.kind is DecisionKind.FIXED:
        scale, zp = observer.calculate_qparams() if hasattr(observer, "calculate_qparams") else (None, None)
        lo, hi = decision.interval
        return f"[{lo:g}, {hi:g}] scale={float(scale):.6g} zp={int(zp)}"
    if observer is not None and getattr(observer, "has_data", False):
        scale, zp = observer.calculate_qparams()
        if scale.numel() == 1:
            return f"scale={float(scale):.6g} zp={int(zp)}"
        return f"per-channel x{scale.numel()}"
    return ""


def _graph_modules(model: nn.Module, prefix: str = ""):
    if isinstance(model, fx.GraphModule) and hasattr(model, OBSERVERS):
        yield prefix, model
    for name, child in model.named_children():
        if name == OBSERVERS:
            continue
        yield from _graph_modules(child, f"{prefix}.{name}" if prefix else name)


def explain(prepared: nn.Module, *, registry=None) -> Explanation:
    """A table of every node of a prepared model: canonical op, observer, qparams or interval,
    where convert will run it (predicted from the lowering tables of ``registry``, default the one
    ``prepared`` was prepared with, else the current one; :func:`lucid_fx.placement.placements`), and the
    rule (file:line) that decided it.

    >>> import torch, lucid_fx
    >>> m = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Tanh()).eval()
    >>> row = lucid_fx.explain(lucid_fx.prepare(m, example_inputs=(torch.randn(1, 2),))).by_node()["_1"]
    >>> row["op"], row["kind"], row["observer"], row["qparams"], row["runs"]
    ('tanh', 'fixed', 'FixedQParamsObserver', '[-1, 1] scale=0.0078125 zp=128', 'int8 kernel')
    """
    rows: List[Dict[str, str]] = []
    registry = registry_of(prepared, registry) or current_registry()
    placed = placements(prepared, registry=registry)
    for prefix, gm in _graph_modules(prepared):
        observers = getattr(gm, OBSERVERS)
        for node in gm.graph.nodes:
            decision = node.meta.get(_meta.DECISION)
            call = canonical(node)
            if decision is None or call is None or node.op == "output":
                continue
            key = node.meta.get(_meta.OBSERVER)
            observer = observers[key] if key is not None and key in observers else None
            rule = decision.rule
            if decision.kind is DecisionKind.FIXED and node.meta.get(_meta.INTERVAL_RULE):
                rule = f"{rule} via {node.meta[_meta.INTERVAL_RULE]}"
            name = f"{prefix}.{node.name}" if prefix else node.name
            where = placed.get(name)
            rows.append(
                {
                    "node": name,
                    "op": call.op,
                    "spelling": call.spelling,
                    "kind": decision.kind.value,
                    "observer": type(observer).__name__ if observer is not None else "-",
                    "qparams": _qparams_text(observer, decision) if observer is not None else "",
                    "runs": where.runs.value if where is not None else "",
                    "runs_why": where.why if where is not None else "",
                    "rule": rule,
                    "reason": decision.reason,
                    "measured": node.meta.get(_meta.MEASURED, ""),
                }
            )
    return Explanation(rows, _predicted_report(prepared, registry))


def _predicted_report(prepared: nn.Module, registry) -> str:
    """The convert report's FLOP share and float regions as predicted now, where anything is float."""
    registry = registry_of(prepared, registry) or current_registry()
    report = getattr(prepared, "lucid_fx_report", None)
    backend = getattr(report, "backend", "cpu")
    table = lowering_table(registry.lowerings, backend)
    graphs = {prefix: ConvertReport(backend, {}, *graph_facts(gm, registry)) for prefix, gm in _graph_modules(prepared)}
    for prefix, gm in _graph_modules(prepared):
        graphs[prefix].placements = predict_placement(gm, table)
    predicted = model_report(backend, graphs, report)
    if not predicted.float_regions:
        return ""
    return "convert will run (predicted):\n" + "\n".join(str(predicted).splitlines()[1:])
