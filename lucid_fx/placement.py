"""placement: what runs where, and why. One answer, read by explain, the convert report, compare,
to_networkx and the viewer, so that they cannot disagree.

convert decides it: ``lower_to_int8`` writes ``node.meta[PLACEMENT]`` on every node of the converted
graph that computes (part of) a prepared node's value, and the same records into the
``ConvertReport``. For a prepared model that is not converted yet, :func:`placements` predicts it
from the lowering table, the way convert will look it up (a rule may still decline at convert
time, for instance where an int32 accumulator could overflow; the convert report then says so).
"""

from __future__ import annotations

from typing import Dict, Iterator, Optional, Tuple

from torch import fx, nn

from lucid_fx import _meta
from lucid_fx._meta import OBSERVERS
from lucid_fx._placement import INT8_RUNS, Placement, Runs
from lucid_fx.passes.lower_to_int8 import lowering_table
from lucid_fx.passes.predict_placement import predict_placement
from lucid_fx._prepared_registry import registry_of
from lucid_fx.registry import current_registry

__all__ = ["Runs", "Placement", "placements", "INT8_RUNS"]


def _graph_modules(model: nn.Module, prefix: str = "") -> Iterator[Tuple[str, fx.GraphModule]]:
    # Every graph, nested ones too: prepare quantizes the traceable children of an untraceable module.
    if isinstance(model, fx.GraphModule):
        yield prefix, model
    for name, child in model.named_children():
        yield from _graph_modules(child, f"{prefix}.{name}" if prefix else name)


def placements(model: nn.Module, *, registry=None, backend: Optional[str] = None) -> Dict[str, Placement]:
    """Where every op of ``model`` runs and why, by prepared-node name (qualified with the submodule
    path for models prepared in parts).

    A converted model answers from what convert wrote on its nodes; a prepared one is predicted
    from the lowering table of ``registry`` (default: the one it was prepared with) for ``backend`` (default:
    the one given to prepare). Graph inputs, constants and plain traced graphs have no entry.

    >>> import torch, lucid_fx
    >>> nn = torch.nn
    >>> m = nn.Sequential(nn.Linear(4, 4), nn.Hardsigmoid(), nn.Linear(4, 4), nn.Softmin(-1), nn.Linear(4, 2)).eval()
    >>> prepared = lucid_fx.prepare(m, example_inputs=(torch.randn(2, 4),))
    >>> [str(placements(prepared)[n]) for n in ("_0", "_1", "_3")]
    ['int8 kernel (linear)', 'table lookup (hardsigmoid)', 'float (no lowering rule for 3)']
    """
    report = getattr(model, "lucid_fx_report", None)
    backend = backend or getattr(report, "backend", None) or "cpu"
    found: Dict[str, Placement] = {}
    for prefix, gm in _graph_modules(model):
        qualify = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
        if hasattr(gm, OBSERVERS):
            table = lowering_table((registry_of(model, registry) or current_registry()).lowerings, backend)
            found.update((qualify(name), p) for name, p in predict_placement(gm, table).items())
            continue
        for node in gm.graph.nodes:
            placement = node.meta.get(_meta.PLACEMENT)
            for name in placement.members if placement is not None else ():
                found.setdefault(qualify(name), placement)
            for name, inside in node.meta.get(_meta.ABSORBED, {}).items():  # computed inside its kernel or table
                found.setdefault(qualify(name), inside)
    return found
