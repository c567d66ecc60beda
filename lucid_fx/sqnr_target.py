"""quantize to a target SQNR: keep the fewest nodes float until the output SQNR on held-out
data meets the target, within a stated budget of rounds.

Each round is one ``prepare`` -> ``calibrate`` -> ``convert`` -> ``compare`` on the held-out
batches. ``compare`` gives every node's SQNR against the float model; a node's *loss* is how many
dB its value has below the best-measured of its inputs: the error it adds itself, not the error
it inherits (a late node's SQNR is low because everything before it rounded too). Nodes are
ranked by loss per cost, the cost being the share of the model's matrix FLOPs the node would
move to float (a LayerNorm, an add or a concat costs next to nothing), and each round keeps
float the next best ``1, 2, 4, ...`` of them (doubling, so the budget of rounds reaches far).
When a round meets the target, the nodes of its last step are dropped again one by one, the
lowest-ranked first, while the rounds allow and the target still holds, so the set is small.
A node whose fused partners (a linear before a ReLU) must follow it float counts them in the
reported FLOPs, not in its rank: the rank sees only its own.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from torch import fx, nn

from lucid_fx import _meta
from lucid_fx._timing import paired_ms
from lucid_fx.calibrate import calibrate
from lucid_fx.compare import compare
from lucid_fx.convert import convert
from lucid_fx.prepare import prepare
from lucid_fx.quantization.qconfig import QConfigMapping, get_default_qconfig_mapping

__all__ = ["TargetReport", "quantize_to_target"]

_MATRIX_OPS = frozenset({"linear", "conv1d", "conv2d", "conv3d", "matmul", "addmm", "bmm", "mm"})
# Ops whose output holds the values of their input, moved: keeping one float changes no grid.
_MOVES_VALUES = frozenset({"reshape", "view", "transpose", "permute", "contiguous", "expand", "dropout", "flatten",
                           "squeeze", "unsqueeze", "identity"})


@dataclass
class TargetReport:
    """What ``quantize(..., target_sqnr_db=...)`` chose: ``float_nodes`` (kept float, by the
    names ``compare`` reports), ``sqnr_db`` (the held-out output SQNR reached), ``met``,
    ``float_flops`` (the share of the model's matrix FLOPs that runs in float; it counts ops float
    without a target too), ``chosen_ms`` and ``int8_ms`` (the speed it costs: milliseconds per call
    of the chosen model and of the first round's, measured on the first held-out batch, the two
    taking turns: :func:`lucid_fx._timing.paired_ms`), ``rounds`` (one line per prepare/calibrate/convert/compare round)."""

    target_sqnr_db: float
    float_nodes: List[str] = field(default_factory=list)
    sqnr_db: float = -math.inf
    met: bool = False
    float_flops: float = 0.0
    rounds: List[str] = field(default_factory=list)
    chosen_ms: float = math.nan
    int8_ms: float = math.nan

    def __str__(self) -> str:
        verdict = "met" if self.met else "NOT met"
        lines = [f"target {self.target_sqnr_db:.1f} dB {verdict}: {self.sqnr_db:.1f} dB with {len(self.float_nodes)} node(s) "
                 f"float ({100 * self.float_flops:.1f}% of matrix FLOPs)"]
        lines += [f"  float: {name}" for name in self.float_nodes]
        if not math.isnan(self.chosen_ms):
            lines.append(f"  speed: {self.chosen_ms:.3g} ms a call, {self.int8_ms:.3g} ms with no node kept float")
        lines += [f"  round {i}: {line}" for i, line in enumerate(self.rounds)]
        return "\n".join(lines)


def _unobserved(value):
    while isinstance(value, fx.Node) and value.op == "call_module" and str(value.target).startswith("lucid_fx_"):
        value = value.args[0]
    return value


def _flops(gm: fx.GraphModule, node: fx.Node) -> int:
    """Matrix FLOPs of one prepared node, from the shapes prepare recorded (0 for other ops)."""
    call, out = node.meta.get(_meta.OP), node.meta.get(_meta.TENSOR_META)
    if call is None or call.op not in _MATRIX_OPS or not hasattr(out, "shape"):
        return 0
    if node.op == "call_module":
        weight = getattr(gm.get_submodule(node.target), "weight", None)
        inner = math.prod(weight.shape[1:]) if weight is not None else 0
    else:
        first = _unobserved(node.args[1 if call.op == "addmm" or call.op.startswith("conv") else 0])
        meta = first.meta.get(_meta.TENSOR_META) if isinstance(first, fx.Node) else None
        shape = tuple(meta.shape) if hasattr(meta, "shape") else ()
        inner = (math.prod(shape[1:]) if call.op.startswith("conv") else shape[-1]) if shape else 0
    return 2 * math.prod(out.shape) * inner


def _graph_facts(prepared: nn.Module) -> Tuple[Dict[str, List[str]], Dict[str, int]]:
    """Per node (by compare's name): the nodes it reads, observers looked through, and its FLOPs."""
    inputs: Dict[str, List[str]] = {}
    flops: Dict[str, int] = {}
    parts = [("", prepared)] if isinstance(prepared, fx.GraphModule) else []
    parts += [(n, m) for n, m in prepared.named_modules() if n and isinstance(m, fx.GraphModule) and hasattr(m, "lucid_fx_observers")]
    for path, gm in parts:
        def name(node: fx.Node) -> str:
            while node.op == "call_module" and str(node.target).startswith("lucid_fx_"):
                node = node.args[0]
            return f"{path}.{node.name}" if path else node.name

        for node in gm.graph.nodes:
            if node.op == "call_module" and str(node.target).startswith("lucid_fx_"):
                continue
            inputs[name(node)] = [name(n) for n in node.all_input_nodes]
            flops[name(node)] = _flops(gm, node)
    return inputs, flops


def _ranked(comparison, inputs: Dict[str, List[str]], flops: Dict[str, int], kept: Sequence[str]) -> List[str]:
    """Quantized nodes by loss (dB below their best input) per unit of FLOPs they would move to
    float. A node that already runs float (a LayerNorm) and still loses passes its loss up to
    the quantized node whose rounded output it reads (its worst input, through float nodes)."""
    rows = comparison.by_node()
    total = max(1, sum(flops.values()))
    losses: Dict[str, float] = {}
    for row in comparison.rows:
        before = [rows[n].sqnr_db for n in inputs.get(row.node, []) if n in rows]
        if not before or not math.isfinite(row.sqnr_db):
            continue  # a parameter or an input: nothing computed here
        loss, node = min(max(before), 200.0) - row.sqnr_db, row.node
        seen = set()
        while rows[node].domain == "float" and node not in seen:  # to where the rounding happened
            seen.add(node)
            node = min((n for n in inputs.get(node, []) if n in rows), key=lambda n: rows[n].sqnr_db, default=node)
        if rows[node].op in _MOVES_VALUES and rows[node].domain != "float" and node == row.node:
            continue  # the same values on the same grid as its input: keeping it float changes nothing
        if node in rows and rows[node].domain != "float" and node not in kept and loss > 0.5:
            losses[node] = max(losses.get(node, 0.0), loss)
    scored = [(loss / (1 + 100 * flops.get(node, 0) / total), node) for node, loss in losses.items()]
    return [node for _, node in sorted(scored, reverse=True)]


def quantize_to_target(
    model: nn.Module,
    example_inputs: Any,
    calibration: List[Any],
    held_out: List[Any],
    target_sqnr_db: float,
    qconfig_mapping: Optional[QConfigMapping],
    *,
    max_rounds: int,
    convert_options: Dict[str, Any],
    prepare_options: Dict[str, Any],
) -> nn.Module:
    """The search behind ``quantize(..., target_sqnr_db=...)`` (module docstring); returns the
    converted model of the best round, its :class:`TargetReport` in ``model.lucid_fx_target``."""

    if max_rounds < 1:
        raise ValueError(f"quantize: max_rounds must be at least 1, got {max_rounds!r}")
    if not isinstance(target_sqnr_db, (int, float)) or isinstance(target_sqnr_db, bool) or not math.isfinite(target_sqnr_db):
        raise ValueError(f"quantize: target_sqnr_db must be a finite number of dB (30 is a common goal), got {target_sqnr_db!r}")
    base = qconfig_mapping if qconfig_mapping is not None else get_default_qconfig_mapping()  # as prepare does
    report, kept, step, best = TargetReport(float(target_sqnr_db)), [], 1, None
    last_step: List[str] = []
    first: Optional[nn.Module] = None  # the first round's model: the speed without any node kept float
    for _ in range(max_rounds):
        mapping = copy.copy(base)
        mapping.node_name_qconfigs = {**base.node_name_qconfigs, **{name: None for name in kept}}
        prepared = prepare(model, mapping, example_inputs, **prepare_options)
        calibrate(prepared, calibration, progress=False)
        inputs, flops = _graph_facts(prepared)
        qmodel = convert(prepared, inplace=True, **convert_options)
        first = qmodel if first is None else first
        comparison = compare(model, qmodel, held_out)
        sqnr = comparison.output_sqnr_db
        # what runs float in the end, fused partners of a kept node and ops float anyway included
        share = sum(flops.get(r.node, 0) for r in comparison.rows if r.domain == "float") / max(1, sum(flops.values()))
        report.rounds.append(f"{len(kept)} float -> {sqnr:.1f} dB ({100 * share:.1f}% FLOPs float)")
        met = sqnr >= target_sqnr_db
        if best is None or (met and (not best[0] or len(kept) < len(best[1]))) or (not best[0] and not met and sqnr > best[2]):
            best = (met, list(kept), sqnr, share, qmodel)
        if met:
            if len(last_step) <= 1:
                break  # without it is the round before, which missed the target
            kept, last_step = kept[:-1], last_step[:-1]  # try without the last one added
            continue
        if best[0]:
            break  # dropping that node lost the target: the best set is found
        ranked = _ranked(comparison, inputs, flops, kept)
        if not ranked:
            break
        last_step = ranked[:step]
        kept, step = kept + last_step, step * 2
    met, report.float_nodes, report.sqnr_db, report.float_flops, qmodel = best
    report.met = met
    report.chosen_ms, report.int8_ms = paired_ms(qmodel, first, held_out[0])
    object.__setattr__(qmodel, "lucid_fx_target", report)
    return qmodel
