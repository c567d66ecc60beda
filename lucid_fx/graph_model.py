"""to_networkx: a prepared, converted or reference model as a ``networkx.DiGraph`` to inspect.

One graph node per FX node that computes something. Observer calls are folded into the node they
watch (its ``observer`` and ``qparams`` attributes) and constants (``get_attr``) into their
consumers' ``constants`` attribute, unless asked for. Every attribute value is a ``str``, ``int``,
``float`` or ``bool`` so that the graph writes to GraphML as it is. Reads the ``node.meta`` keys
that prepare and convert write (see :mod:`lucid_fx._meta`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, Iterator, Optional, Tuple

import networkx as nx
import torch
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx._meta import OBSERVERS, WEIGHT_OBSERVERS
from lucid_fx.ops import canonical
from lucid_fx.placement import INT8_RUNS, Placement, placements
from lucid_fx.rules.observers import DecisionKind

__all__ = ["to_networkx", "DOMAINS"]

#: Domains a node's output can be in, as ``to_networkx`` labels them.
DOMAINS = {
    "int8": "integer codes on a calibrated grid",
    "fixed": "integer codes on a fixed grid (range-bounded op)",
    "float": "float tensor",
    "boundary": "quantize or dequantize between the two",
    "io": "graph input or output",
    "const": "a weight or buffer",
}

_BOUNDARY = ("quantize_per_tensor", "dequantize_per_tensor", "quantize_per_channel", "dequantize_per_channel")


def _graph_modules(model: nn.Module, prefix: str = "") -> Iterator[Tuple[str, fx.GraphModule]]:
    if isinstance(model, fx.GraphModule):
        yield prefix, model
        return
    for name, child in model.named_children():
        yield from _graph_modules(child, f"{prefix}.{name}" if prefix else name)


def _target_text(node: fx.Node) -> str:
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverloadPacket) or isinstance(target, torch._ops.OpOverload):
        return str(target)
    module = getattr(target, "__module__", None) or ""
    return f"{module}.{getattr(target, '__qualname__', getattr(target, '__name__', repr(target)))}".lstrip(".")


def _op_name(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "input"
    call = canonical(node)
    if call is not None and getattr(call, "op", None):
        return call.op
    if node.op in ("output", "get_attr"):
        return node.op
    target = node.target
    if isinstance(target, (torch._ops.OpOverloadPacket, torch._ops.OpOverload)):
        text = str(target).replace("::", ".")
        return text.split(".")[1] if text.startswith("lucid_fx.") else text
    return target if isinstance(target, str) else getattr(target, "__name__", str(target))


def _shape_dtype(node: fx.Node, fake: Dict[fx.Node, Tuple[str, str]]) -> Tuple[str, str]:
    meta = node.meta.get(_meta.TENSOR_META)
    if meta is not None and hasattr(meta, "shape"):
        return "x".join(str(d) for d in meta.shape), str(meta.dtype).replace("torch.", "")
    known = node.meta.get(_meta.VALUE_TYPE)
    if known is not None:
        return "x".join(str(d) for d in known[0]), str(known[1]).replace("torch.", "")
    return fake.get(node, ("", ""))


def _fake_shapes(gm: fx.GraphModule) -> Dict[fx.Node, Tuple[str, str]]:
    """Shapes and dtypes of every node, computed on fake tensors from the inputs' recorded shapes
    (converted graphs keep them on their placeholders); empty when that is not possible."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    inputs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        meta = node.meta.get(_meta.TENSOR_META)
        if meta is None or not hasattr(meta, "shape"):
            return {}
        inputs.append(meta)
    found: Dict[fx.Node, Tuple[str, str]] = {}

    class _Recorder(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                found[n] = ("x".join(str(d) for d in out.shape), str(out.dtype).replace("torch.", ""))
            return out

    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode:
            args = [mode.from_tensor(torch.empty(m.shape, dtype=m.dtype)) for m in inputs]
            _Recorder(gm).run(*args)
    except Exception:  # noqa: BLE001 - shapes are a nicety; the graph is drawn without them
        return found
    return found


def _observer_attrs(observer: nn.Module, decision: Any) -> Dict[str, Any]:
    attrs: Dict[str, Any] = {"observer": type(observer).__name__}
    qdtype = getattr(observer, "qdtype", None)
    if qdtype is not None:
        attrs["qdtype"] = qdtype.name
    fixed = decision is not None and decision.kind is DecisionKind.FIXED
    if fixed or getattr(observer, "has_data", False):
        scale, zero_point = observer.calculate_qparams()
        if scale.numel() == 1:
            attrs["scale"], attrs["zero_point"] = float(scale), int(zero_point)
            attrs["qparams"] = f"scale={float(scale):.6g} zp={int(zero_point)}"
        else:
            attrs["qparams"] = f"per-channel x{scale.numel()}"
    else:
        attrs["qparams"] = "not calibrated"
    return attrs


def _domain(node: fx.Node, attrs: Dict[str, Any], placement: Optional[Placement]) -> str:
    if node.op in ("placeholder", "output"):
        return "io"
    if node.op == "get_attr":
        return "const"
    if attrs["op"] in _BOUNDARY:
        return "boundary"
    decision = node.meta.get(_meta.DECISION)
    fixed = (decision is not None and decision.kind is DecisionKind.FIXED) or attrs.get("observer") == "FixedQParamsObserver"
    if placement is not None:  # prepared or converted: where the node runs (lucid_fx.placement)
        return ("fixed" if fixed else "int8") if placement.runs in INT8_RUNS else "float"
    if _meta.QPARAMS in node.meta:  # a reference graph's quantize pair: integer codes
        return "fixed" if fixed else "int8"
    return "int8" if decision is not None and decision.kind is DecisionKind.FUSED else "float"


def _node_attrs(node: fx.Node, name: str, fake, observers, weight_observers, placement) -> Dict[str, Any]:
    attrs: Dict[str, Any] = {"name": name, "fx_op": node.op, "target": _target_text(node), "op": _op_name(node)}
    attrs["shape"], attrs["dtype"] = _shape_dtype(node, fake)
    for key, attr in ((_meta.MODULE_PATH, "module_path"), (_meta.SOURCE, "source"), (_meta.LOWERING, "lowering")):
        if node.meta.get(key):
            attrs[attr] = str(node.meta[key])
    decision = node.meta.get(_meta.DECISION)
    if decision is not None:
        attrs["decision"], attrs["rule"], attrs["reason"] = decision.kind.value, decision.rule, decision.reason
    interval = node.meta.get(_meta.INTERVAL)
    if interval is not None:
        lo, hi = interval
        attrs["interval"] = f"[{lo:g}, {hi:g}]"
        if node.meta.get(_meta.INTERVAL_RULE):
            attrs["interval_rule"] = node.meta[_meta.INTERVAL_RULE]
    key = node.meta.get(_meta.OBSERVER)
    if key is not None and key in observers:
        attrs.update(_observer_attrs(observers[key], decision))
    wkey = node.meta.get(_meta.WEIGHT_OBSERVER)
    if wkey is not None and wkey in weight_observers:
        attrs["weight_observer"] = type(weight_observers[wkey]).__name__
    if _meta.QPARAMS in node.meta:
        scale, zero_point, grid = node.meta[_meta.QPARAMS]
        attrs.update(scale=float(scale), zero_point=int(zero_point), qdtype=str(grid))
        attrs["qparams"] = f"scale={float(scale):.6g} zp={int(zero_point)}"
    if node.meta.get(_meta.OBSERVER_KIND):
        attrs["observer"] = node.meta[_meta.OBSERVER_KIND]
    if placement is not None:
        attrs["runs"], attrs["runs_why"] = placement.runs.value, placement.why
    attrs["domain"] = _domain(node, attrs, placement)
    return attrs


def _is_observer(node: fx.Node) -> bool:
    return node.op == "call_module" and isinstance(node.target, str) and node.target.startswith(OBSERVERS + ".")


def to_networkx(model: nn.Module, *, comparison: Optional[Any] = None, constants: bool = False) -> nx.DiGraph:
    """The graph of ``model`` (prepared, converted, reference or any GraphModule) as a DiGraph.

    Node keys are FX node names (prefixed with the submodule path for models that were prepared
    in parts). Attributes: ``name``, ``fx_op``, ``op`` (canonical op), ``target``, ``shape``,
    ``dtype``, ``domain`` (a key of :data:`DOMAINS`), and where known ``observer``, ``qparams``,
    ``scale``, ``zero_point``, ``qdtype``, ``interval``, ``decision``, ``rule``, ``reason``,
    ``lowering``, ``module_path``, ``runs`` and ``runs_why`` (where the node runs and why, from
    :func:`lucid_fx.placement.placements`; the domain follows it) and, given a
    :func:`lucid_fx.compare` result, ``sqnr_db`` and ``max_abs``. With ``constants=True`` weights
    and buffers are nodes too.

    >>> import torch, lucid_fx
    >>> m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid()).eval()
    >>> g = lucid_fx.to_networkx(lucid_fx.prepare(m, example_inputs=(torch.randn(2, 4),)))
    >>> list(g.nodes)
    ['input_1', '_0', '_1', 'output']
    >>> g.nodes["_1"]["domain"], g.nodes["_1"]["observer"], g.nodes["_1"]["qparams"], g.nodes["_1"]["shape"]
    ('fixed', 'FixedQParamsObserver', 'scale=0.00390625 zp=0', '2x4')
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"to_networkx expects an nn.Module (a prepared or converted model), got {type(model).__name__}")
    parts = list(_graph_modules(model))
    if not parts:
        raise ValueError(
            f"{type(model).__name__} holds no torch.fx GraphModule: pass the result of lucid_fx.prepare, "
            "convert or torch.fx.symbolic_trace"
        )
    rows = comparison.by_node() if comparison is not None else {}
    measured = {row.measured: row for row in rows.values()}
    placed = placements(model)
    graph = nx.DiGraph()
    for prefix, gm in parts:
        observers = getattr(gm, OBSERVERS, {})
        weight_observers = getattr(model, WEIGHT_OBSERVERS, getattr(gm, WEIGHT_OBSERVERS, {}))
        drawn = [n for n in gm.graph.nodes if n.op not in ("output", "get_attr") and not _is_observer(n)]
        known = all(_meta.TENSOR_META in n.meta or _meta.VALUE_TYPE in n.meta for n in drawn)
        fake = {} if known else _fake_shapes(gm)
        qualified = (lambda n: f"{prefix}.{n}") if prefix else (lambda n: n)
        alias: Dict[fx.Node, fx.Node] = {}
        folded: Dict[fx.Node, list] = {}
        for node in gm.graph.nodes:
            if _is_observer(node):
                source = node.args[0]
                alias[node] = alias.get(source, source)
                continue
            if node.op == "get_attr" and not constants:
                for user in node.users:
                    folded.setdefault(user, []).append(str(node.target))
                continue
            where = node.meta.get(_meta.PLACEMENT) if _meta.SOURCE in node.meta else placed.get(qualified(node.name))
            attrs = _node_attrs(node, qualified(node.name), fake, observers, weight_observers, where)
            if prefix:
                attrs["graph"] = prefix
            if node in folded:
                attrs["constants"] = ", ".join(folded[node])
            row = measured.get(attrs["name"])
            if row is None and _meta.SOURCE not in node.meta:  # a float or prepared graph: same names
                row = rows.get(attrs["name"])
            if row is not None:
                attrs["sqnr_db"] = row.sqnr_db if math.isfinite(row.sqnr_db) else (999.0 if row.sqnr_db > 0 else -999.0)
                attrs["max_abs"] = row.max_abs
            graph.add_node(qualified(node.name), **attrs)
            for source in node.all_input_nodes:
                source = alias.get(source, source)
                if source.op == "get_attr" and not constants:
                    continue
                graph.add_edge(qualified(source.name), qualified(node.name))
    return graph
