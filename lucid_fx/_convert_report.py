"""The convert report of a whole model: each graph's :class:`ConvertReport` (with the FLOPs of its
matrix ops and the opaque calls it makes, read from the prepared graph) merged into one, with the
modules the untraceable-module fallback kept float and the FLOPs of their own code."""

from __future__ import annotations

from typing import Any, Dict, Iterable, Mapping, Optional, Tuple

from torch import fx

from lucid_fx._flops import graph_flops
from lucid_fx._meta import OBSERVERS, WEIGHT_OBSERVERS
from lucid_fx._placement import ConvertReport, Placement
from lucid_fx.registry import Registry

__all__ = ["graph_facts", "model_report"]

# where a function that canonicalize_ops does not know comes from, when it is not a user's opaque function
_LIBRARY_MODULES = ("torch", "_operator", "operator", "builtins", "math", "_tensor")


def _opaque(gm: fx.GraphModule, node: fx.Node, registry: Registry) -> Optional[Tuple[str, str]]:
    """("function", name) for a call of a function lucid_fx cannot see into (autowrapped, a leaf
    function), ("leaf module", path) for a module kept as one node; None for anything else."""
    if node.op == "call_module" and not str(node.target).startswith((OBSERVERS, WEIGHT_OBSERVERS)):
        if registry.spelling_for("call_module", gm.get_submodule(node.target)) is None:
            return ("leaf module", str(node.target))
    if node.op == "call_function" and registry.spelling_for("call_function", node.target) is None:
        module = getattr(node.target, "__module__", None) or ""
        if not module.split(".")[0].startswith(_LIBRARY_MODULES):
            return ("function", getattr(node.target, "__qualname__", str(node.target)))
    return None


def graph_facts(gm: fx.GraphModule, registry: Registry) -> Tuple[Dict[str, int], Dict[str, Tuple[str, str]]]:
    """A calibrated prepared graph's matrix FLOPs by node and its opaque calls by node (before convert
    folds batch norms and replaces the nodes)."""
    opaque = {n.name: found for n in gm.graph.nodes if (found := _opaque(gm, n, registry)) is not None}
    return graph_flops(gm), opaque


def _qualify(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _parent(path: str) -> str:
    return path.rpartition(".")[0]


def _between(path: str, top: str) -> Iterable[str]:
    """The ancestors of ``path`` strictly below ``top``."""
    while "." in path:
        path = _parent(path)
        if path == top:
            return
        yield path


def _measured(path: str, counts: Mapping[str, int]) -> int:
    """FLOPs of a module's calls; for one never called (a ModuleList), its topmost called descendants'."""
    if path in counts:
        return counts[path]
    below = [p for p in counts if p and (p.startswith(path + ".") or not path)]
    return sum(counts[p] for p in below if not any(a in counts for a in _between(p, path)))


def _own_flops(float_modules: Iterable[str], parts: Iterable[str], counts: Mapping[str, int]) -> Dict[str, int]:
    """FLOPs of each float module's own float code: its calls less those of its children that prepare
    quantized as parts of their own (graphs, or float modules in turn)."""
    parts = set(parts)
    own = {}
    for path in float_modules:
        children = [p for p in parts if p != path and (_parent(p) == path if path else "." not in p)]
        own[path] = max(0, _measured(path, counts) - sum(_measured(c, counts) for c in children))
    return own


def model_report(backend: str, reports: Mapping[str, ConvertReport], prepare_report: Any) -> ConvertReport:
    """One report for the converted model: the graphs' placements, FLOPs and opaque calls by
    qualified node name, and the float modules with the FLOPs prepare measured in them."""
    merged = ConvertReport(next(iter(reports.values())).backend if reports else backend)
    for prefix, report in reports.items():
        # A call of a module prepared as a part of its own (captured when its parent's trace could
        # not see into it) is no float region: the part's own report places its nodes and FLOPs.
        calls_part = {n for n, (kind, what) in report.opaque.items() if kind == "leaf module" and _qualify(prefix, what) in reports}
        qualified: Dict[int, Placement] = {}  # one Placement per fused group, as in each graph's report
        for name, p in report.placements.items():
            if name in calls_part:
                continue
            if id(p) not in qualified:
                qualified[id(p)] = Placement(p.runs, p.why, tuple(_qualify(prefix, m) for m in p.members)) if prefix else p
            merged.placements[_qualify(prefix, name)] = qualified[id(p)]
        merged.flops.update((_qualify(prefix, n), f) for n, f in report.flops.items() if n not in calls_part)
        merged.folded_flops += report.folded_flops
        merged.opaque.update((_qualify(prefix, n), (kind, _qualify(prefix, what) if kind == "leaf module" else what))
                             for n, (kind, what) in report.opaque.items() if n not in calls_part)
    entries = list(getattr(prepare_report, "float_modules", ()))
    merged.float_modules = {u.path: f"{u.type_name} at {u.source_line}: {u.error}" for u in entries}
    counts = getattr(prepare_report, "module_flops", {}) or {}
    merged.module_flops = _own_flops(merged.float_modules, set(reports) | set(merged.float_modules), counts)
    for node, (kind, path) in merged.opaque.items():  # a leaf module's FLOPs, measured at prepare
        if kind == "leaf module" and path not in merged.float_modules and path in counts:
            merged.flops[node] = counts[path]
    return merged
