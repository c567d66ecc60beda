"""quantize with a measured precision per region: int8 where it pays, float where it does not.

Prepare tags the ops whose int8 form may cost more than it saves (``MEASURED_OPS``: the attention
core and elementwise tails, never a linear or a conv) with ``node.meta[MEASURED]``. Tagged nodes
joined directly, or through ops that only move codes (a transpose between two matmuls), form a
*region*; regions with the same ops on the same shapes (the same block repeated through a model)
form a *group*, decided together. Every group, largest first, gets one round: the model is
prepared, calibrated and converted with the group (and the groups chosen before it) in float,
timed against the model with every candidate int8 (the two taking turns on the first held-out
batch, so that the ties of several groups do not add up), and compared with the float model on
the held-out batches. The group runs float when that is more accurate than the best model so far
(by over 0.1 dB) and at most ``tie`` slower, or as accurate (within 0.1 dB) and more than ``tie``
faster; otherwise it stays int8 (:func:`prefers_float`). An op whose QConfig an entry of the
mapping names is no candidate (it runs int8, forced); ``set_object_type(op, None)`` keeps it
float, forced.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

from torch import fx, nn

from lucid_fx import _meta
from lucid_fx._timing import paired_ms
from lucid_fx.calibrate import calibrate
from lucid_fx.compare import compare
from lucid_fx.convert import convert
from lucid_fx.explain import _graph_modules
from lucid_fx.ops import canonical
from lucid_fx.prepare import prepare
from lucid_fx.quantization.qconfig import QConfigMapping
from lucid_fx.registry import Registry, current_registry, register_observer_rule
from lucid_fx.rules.lowering_context import _is_observer_call
from lucid_fx.rules.observers import ANY, Decision, DecisionKind

__all__ = ["PrecisionChoice", "PrecisionReport", "quantize_measured", "prefers_float"]


# SQNRs closer than this count as equal (the report prints them to 0.1 dB).
EQUAL_DB = 0.1


@dataclass
class PrecisionChoice:
    """One group of regions: its ``nodes`` (by compare's names), ``ops`` (one region's, in graph
    order), how many ``regions`` it holds, and the measurements of its round: milliseconds a call
    of the model with every candidate int8 (``int8_ms``) and with this group and those chosen before
    it float (``float_ms``), output SQNR in dB of the best model before it (``int8_db``) and with it float."""

    nodes: List[str]
    ops: str
    regions: int
    int8_ms: float = math.nan
    float_ms: float = math.nan
    int8_db: float = math.nan
    float_db: float = math.nan
    runs: str = "int8"  # "float" where chosen; "int8 (not measured: past max_rounds)" past the round budget

    def why(self, tie: float) -> str:
        if self.float_db > self.int8_db + EQUAL_DB:
            verdict = "more accurate and " + ("faster" if self.float_ms < self.int8_ms else f"at most {100 * tie:.0f}% slower")
        else:
            verdict = f"as accurate and over {100 * tie:.0f}% faster"
        return (f"runs in float, measured {verdict}: {self.float_ms:.3g} against "
                f"{self.int8_ms:.3g} ms a call, {self.float_db:.1f} against {self.int8_db:.1f} dB (precision='measured')")


@dataclass
class PrecisionReport:
    """What ``quantize(..., precision="measured")`` chose, group by group (``choices``), with the
    tie it allowed, the held-out SQNR of the model with every candidate int8 and of the chosen one,
    and their milliseconds a call, measured in the same round (the one that chose the last float
    group, else the first)."""

    tie: float
    choices: List[PrecisionChoice] = field(default_factory=list)
    int8_ms: float = math.nan
    chosen_ms: float = math.nan
    int8_db: float = math.nan
    chosen_db: float = math.nan

    @property
    def float_nodes(self) -> List[str]:
        return [n for c in self.choices if c.runs == "float" for n in c.nodes]

    def __str__(self) -> str:
        if not self.choices:
            return "precision measured: no candidate regions, so every op runs as with precision='int8'"
        timed = not math.isnan(self.int8_ms)
        lines = [f"precision measured: {len(self.float_nodes)} node(s) float; "
                 + (f"{self.chosen_ms:.3g} ms a call, " if timed else "")
                 + f"{self.chosen_db:.1f} dB (all int8: " + (f"{self.int8_ms:.3g} ms, " if timed else "")
                 + f"{self.int8_db:.1f} dB; tie {100 * self.tie:.0f}%)"]
        for c in self.choices:
            measured = (f": int8 {c.int8_ms:.3g} ms {c.int8_db:.1f} dB, float {c.float_ms:.3g} ms {c.float_db:.1f} dB"
                        if not math.isnan(c.float_ms) else "")
            lines.append(f"  {c.runs}: {c.ops} x{c.regions} ({', '.join(c.nodes[:4])}{', ...' if len(c.nodes) > 4 else ''}){measured}")
        return "\n".join(lines)


def prefers_float(int8_ms: float, float_ms: float, int8_db: float, float_db: float, tie: float) -> bool:
    """The rule: float when it is more accurate (by over ``EQUAL_DB``) and at most ``tie`` slower,
    or as accurate (within ``EQUAL_DB``) and faster by more than ``tie``: within the tie, time
    differences are taken as noise, and the more accurate choice (or int8, the default) stays."""
    if float_db > int8_db + EQUAL_DB:
        return float_ms <= int8_ms * (1.0 + tie)
    return float_db >= int8_db - EQUAL_DB and float_ms < int8_ms * (1.0 - tie)


def _moves_codes(node: fx.Node) -> bool:
    """An observer call, or an op whose output shares its input's grid (a view, a transpose)."""
    if _is_observer_call(node):
        return True
    decision = node.meta.get(_meta.DECISION)
    return decision is not None and decision.kind is DecisionKind.SHARED and _meta.MEASURED not in node.meta


def _regions(gm: fx.GraphModule) -> List[List[fx.Node]]:
    """Connected regions of candidates, through the code-moving ops between two of them, in graph
    order. A candidate ending a fused group (a masked softmax) reads what its members read."""
    owner: Dict[fx.Node, int] = {}
    regions: List[List[fx.Node]] = []
    groups: Dict[str, List[fx.Node]] = {}
    for node in gm.graph.nodes:
        if node.meta.get(_meta.FUSED_INTO) is not None:
            groups.setdefault(node.meta[_meta.FUSED_INTO], []).append(node)
    for node in gm.graph.nodes:
        if _meta.MEASURED not in node.meta:
            continue
        joined, paths = set(), []
        members = groups.get(node.name, [node])
        for source in (s for m in members for s in m.all_input_nodes if s not in members):
            path = []
            while _moves_codes(source) and len(source.all_input_nodes) == 1:
                path.append(source)
                source = source.all_input_nodes[0]
            if source in owner:
                joined.add(owner[source])
                paths.extend(p for p in path if not _is_observer_call(p))
        region = sorted(joined)
        index = region[0] if region else len(regions)
        if not region:
            regions.append([])
        for other in region[1:]:
            regions[index].extend(regions[other])
            for member in regions[other]:
                owner[member] = index
            regions[other] = []
        for member in paths + [node]:
            if member not in owner:
                owner[member] = index
                regions[index].append(member)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    return [sorted(r, key=order.__getitem__) for r in regions if r]


def _groups(prepared: nn.Module) -> List[Tuple[str, List[List[str]]]]:
    """Regions grouped by their ops and shapes; each group as (ops, regions of qualified names), largest first."""
    groups: Dict[Tuple, List[List[str]]] = {}
    sizes: Dict[Tuple, int] = {}
    for path, gm in _graph_modules(prepared):  # the prepared graphs, named as compare names them
        for region in _regions(gm):
            shapes = tuple((canonical(n).op, tuple(getattr(n.meta.get(_meta.TENSOR_META), "shape", ()))) for n in region)
            groups.setdefault(shapes, []).append([f"{path}.{n.name}" if path else n.name for n in region])
            sizes[shapes] = sizes.get(shapes, 0) + sum(math.prod(s) for _, s in shapes)
    ranked = sorted(groups, key=lambda key: -sizes[key])
    return [("+".join(op for op, _ in key), groups[key]) for key in ranked]


def _float_rule(registry: Registry, reasons: Dict[str, str]) -> Registry:
    """A copy of ``registry`` with one observer rule: the nodes of ``reasons`` run float, saying why."""
    registry = registry.copy()

    def keep_float(node: fx.Node, ctx) -> Optional[Decision]:
        why = reasons.get(".".join(p for p in (ctx.path_prefix, node.name) if p))
        return Decision(DecisionKind.FLOAT, why, keep_float=True) if why is not None else None

    register_observer_rule(ANY, keep_float, registry=registry)
    return registry


def quantize_measured(
    model: nn.Module,
    example_inputs: Any,
    calibration: List[Any],
    held_out: List[Any],
    qconfig_mapping: Optional[QConfigMapping],
    *,
    max_rounds: int,
    tie: float,
    backend: Optional[str],
    registry: Optional[Registry],
    prepare_options: Dict[str, Any],
) -> nn.Module:
    """The search behind ``quantize(..., precision="measured")`` (module docstring); returns the
    chosen converted model with its :class:`PrecisionReport` as ``lucid_fx_precision``."""
    if max_rounds < 1:
        raise ValueError(f"quantize: max_rounds must be at least 1, got {max_rounds!r}")
    if not tie >= 0:
        raise ValueError(f"quantize: precision_tie must be a fraction >= 0 (0.03 allows float 3% slower), got {tie!r}")
    base = registry if registry is not None else current_registry()

    def build(reasons: Dict[str, str]) -> Tuple[nn.Module, List[Tuple[str, List[List[str]]]]]:
        reg = _float_rule(base, reasons) if reasons else base
        mapping = copy.copy(qconfig_mapping) if qconfig_mapping is not None else None
        prepared = prepare(model, mapping, example_inputs, backend=backend, registry=reg, **prepare_options)
        calibrate(prepared, calibration, progress=False)
        groups = _groups(prepared) if not reasons else []
        return convert(prepared, backend=backend, inplace=True, registry=reg), groups

    first, groups = build({})
    best, best_db = first, compare(model, first, held_out).output_sqnr_db
    report = PrecisionReport(float(tie), int8_db=best_db, chosen_db=best_db)
    chosen: Dict[str, str] = {}
    for index, (ops, regions) in enumerate(groups):
        choice = PrecisionChoice([n for r in regions for n in r], ops, len(regions))
        report.choices.append(choice)
        if index >= max_rounds - 1:
            choice.runs = "int8 (not measured: past max_rounds)"
            continue
        trial, _ = build({**chosen, **dict.fromkeys(choice.nodes, "measured in float (precision='measured')")})
        # Against the model with every candidate int8, so that the ties of several groups do not add up.
        choice.int8_db, choice.float_db = max(best_db, report.int8_db), compare(model, trial, held_out).output_sqnr_db
        choice.int8_ms, choice.float_ms = paired_ms(first, trial, held_out[0])
        if math.isnan(report.int8_ms):
            report.int8_ms = report.chosen_ms = choice.int8_ms
        if prefers_float(choice.int8_ms, choice.float_ms, choice.int8_db, choice.float_db, tie):
            choice.runs = "float"
            chosen.update(dict.fromkeys(choice.nodes, choice.why(tie)))
            best, best_db = trial, choice.float_db
            report.int8_ms, report.chosen_ms = choice.int8_ms, choice.float_ms
    if chosen:  # built once more, so that the convert report gives each float node its measurements
        best, _ = build(chosen)
    report.chosen_db = best_db
    best.lucid_fx_precision = report
    return best
