"""insert_observers: put the chosen observers into the graph.

Reads ``node.meta[DECISION]``; adds observer modules under the root's ``lucid_fx_observers``
(one per observed node, named after it where the name is free) and calls them right after the
node they watch; a ``shared`` node calls its input's observer again, so both carry one set of qparams. Weight
observers (per-channel by default) go under ``lucid_fx_weight_observers`` and see the weight
once, now (a grouped product's experts too, their rows as a linear's). Writes ``node.meta[OBSERVER]`` and ``node.meta[WEIGHT_OBSERVER]``.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx._meta import OBSERVERS, WEIGHT_OBSERVERS
from lucid_fx.kernels.target import Target
from lucid_fx.node_refs import layer_groups
from lucid_fx.quantization.dtypes import QDtype
from lucid_fx.quantization.fake_quantize import FakeQuantize, FixedQParamsFakeQuantize
from lucid_fx.quantization.qconfig import QConfig, default_qconfig
from lucid_fx.quantization.qconfig import fixed_qparams_observer
from lucid_fx.ops import Tag, canonical, ops_tagged
from lucid_fx.rules.lowering_grouped import expert_weights
from lucid_fx.computed_weights import from_parameters, parameter_value
from lucid_fx.rules.float_policies import FLOAT_BY_DESIGN
from lucid_fx.rules.movers import item_source
from lucid_fx.rules.observers import DecisionKind

__all__ = ["insert_observers"]

_WEIGHTED = ops_tagged(Tag.WEIGHTED) - FLOAT_BY_DESIGN.keys()  # whose weights a kernel reads as int8
_EXPERT_PRODUCTS = {"grouped_mm"}  # whose weight operand is a stack of experts' weights (rules/lowering_grouped.py)


def _container(gm: fx.GraphModule, name: str) -> nn.ModuleDict:
    if not hasattr(gm, name):
        gm.add_module(name, nn.ModuleDict())
    return getattr(gm, name)


def _make_observer(decision, qat: bool) -> nn.Module:
    qconfig: QConfig = decision.qconfig or default_qconfig
    if decision.kind is DecisionKind.FIXED:
        qdtype = qconfig.activation_qdtype
        lo, hi = decision.interval
        factory = fixed_qparams_observer(lo, hi, qdtype)
        return FixedQParamsFakeQuantize(factory) if qat else factory()
    return qconfig.activation()


def _free_key(container: nn.ModuleDict, name: str) -> str:
    """``name``, unless it is an attribute of ModuleDict itself: a node called ``to`` or ``float``
    (``x.to(dtype)``, ``x.float()``) cannot name a submodule."""
    key = name
    while hasattr(container, key) and key not in container:
        key += "_observer"
    return key


def _observer_of(node: fx.Node) -> Optional[str]:
    return node.meta.get(_meta.OBSERVER)


def _insert_call(gm: fx.GraphModule, node: fx.Node, key: str) -> None:
    graph = gm.graph
    with graph.inserting_after(node):
        obs_node = graph.call_module(f"{OBSERVERS}.{key}", (node,))
    node.replace_all_uses_with(obs_node, delete_user_cb=lambda user: user is not obs_node)
    node.meta[_meta.OBSERVER] = key
    obs_node.meta[_meta.OBSERVER] = key


def _narrow_to(fake_quant: nn.Module, target: Optional[Target], weight: torch.Tensor, groups: int) -> nn.Module:
    """Train on the grid the int8 kernels compute exactly (``target.layer_weight_range``: [-64, 63] on
    CPUs without VNNI but for depthwise convolutions), so the converted weights are the ones training saw."""
    if target is None or not isinstance(fake_quant, FakeQuantize):
        return fake_quant
    qmin, qmax = target.layer_weight_range(weight.shape, groups)
    qdtype = fake_quant.qdtype
    if qdtype.signed and (qdtype.quant_min < qmin or qdtype.quant_max > qmax):
        grid = QDtype(f"qint[{qmin},{qmax}]", qdtype.bits, True, qmin, qmax, qdtype.storage)
        fake_quant.activation_post_process.qdtype = grid
        fake_quant.qdtype, fake_quant.quant_min, fake_quant.quant_max = grid, qmin, qmax
    return fake_quant


def _observe_weight(gm: fx.GraphModule, node: fx.Node, qat: bool, target: Optional[Target]) -> None:
    call = canonical(node)
    qconfig: QConfig = node.meta[_meta.DECISION].qconfig or default_qconfig
    if node.op == "call_module":
        module = gm.get_submodule(node.target)
        key = node.target.replace(".", "__")
        if qat:
            # Train against fake-quantized weights: the module's weight is seen through the fake quant,
            # which convert finds again (with its trained qparams) in the weight-observer container.
            fake_quant = _narrow_to(qconfig.weight().to(module.weight.device), target, module.weight, layer_groups(gm, node))
            torch.nn.utils.parametrize.register_parametrization(module, "weight", fake_quant, unsafe=True)
            _container(gm, WEIGHT_OBSERVERS)[key] = fake_quant
        else:
            observer = qconfig.weight().to(module.weight.device)
            with torch.no_grad():
                observer(module.weight)
            _container(gm, WEIGHT_OBSERVERS)[key] = observer
        node.meta[_meta.WEIGHT_OBSERVER] = key
        return
    weight = call.args.get("weight")
    if from_parameters(weight) and _observer_of(weight) is None:  # self.w, or computed from parameters (F.normalize(self.w))
        key = f"w_{weight.name}"
        fake_quant = _narrow_to(qconfig.weight(), target, parameter_value(weight), layer_groups(gm, node)) if qat else None
        _container(gm, OBSERVERS)[key] = fake_quant if qat else qconfig.weight()
        _insert_call(gm, weight, key)
        node.meta[_meta.WEIGHT_OBSERVER] = key


def _observe_experts(gm: fx.GraphModule, node: fx.Node) -> None:
    """The QConfig's weight observer for a grouped product's experts, as for a linear's weight: it sees
    their (E * N, K) rows once, now, and convert observes them afresh with a copy of it."""
    attr = lambda n: functools.reduce(getattr, n.target.split("."), gm) if n.op == "get_attr" else None  # noqa: E731
    weight = expert_weights(attr, canonical(node).args.get("weight"))
    if weight is None:
        return  # a weight computed in the graph: the product stays float
    qconfig: QConfig = node.meta[_meta.DECISION].qconfig or default_qconfig
    observer = qconfig.weight().to(weight.device)
    with torch.no_grad():
        observer(weight.flatten(0, 1))
    container = _container(gm, WEIGHT_OBSERVERS)
    key = _free_key(container, f"{node.name}_experts")
    container[key] = observer
    node.meta[_meta.WEIGHT_OBSERVER] = key


def insert_observers(
    gm: fx.GraphModule, *, qat: bool = False, target: Optional[Target] = None
) -> fx.GraphModule:
    """Insert observer calls into ``gm`` (in place) according to ``node.meta[DECISION]``; with
    ``qat``, weights are fake-quantized on ``target``'s grid for the layer (the kernels') when narrower."""
    observers = _container(gm, OBSERVERS)
    for node in list(gm.graph.nodes):
        decision = node.meta.get(_meta.DECISION)
        if decision is None or node.op == "call_module" and node.target.startswith(OBSERVERS + "."):
            continue
        if decision.kind in (DecisionKind.FIXED, DecisionKind.STATISTICS):
            observer = _make_observer(decision, qat)
            if hasattr(observer, "observer_name"):
                observer.observer_name = f"observer of node {node.name!r}"
            key = _free_key(observers, node.name)
            observers[key] = observer
            _insert_call(gm, node, key)
        elif decision.kind is DecisionKind.SHARED:
            item_of = item_source(node)  # chunk(x)[i] shares x's observer
            sources = [item_of] if item_of is not None else canonical(node).tensor_inputs()
            source = next((n for n in sources if _observer_of(n)), None)
            if source is not None:
                _insert_call(gm, node, _observer_of(source))
        if decision.kind in (DecisionKind.STATISTICS, DecisionKind.FUSED, DecisionKind.FIXED) and canonical(node).op in _WEIGHTED:
            _observe_weight(gm, node, qat, target)
        elif decision.kind is DecisionKind.STATISTICS and canonical(node).op in _EXPERT_PRODUCTS:
            _observe_experts(gm, node)
    device = next((t.device for t in gm.parameters()), None)
    if device is not None:  # a model on the GPU calibrates there: its observers' state lives beside its values
        observers.to(device)
    gm.graph.lint()
    gm.recompile()
    return gm
