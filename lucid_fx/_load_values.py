"""What a decoded value may be, by where it sits in a file: node arguments, node.meta, attributes.

Node arguments are data: numbers, strings, tensors' dtypes and devices, slices, containers and
references to earlier nodes; never a function or class (unless the caller allowed it). A
``node.meta`` value must have the type its key is documented with in :mod:`lucid_fx._meta`, and
a dataclass (a Decision, a report) the types its fields are annotated with, so that convert,
explain and the viewer read what they expect.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import types
import typing
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from lucid_fx import _allowlist as A
from lucid_fx import _meta
from lucid_fx._meta import OBSERVERS, WEIGHT_OBSERVERS

__all__ = ["check_data", "check_meta", "conforms", "LUCID_FX_ATTRIBUTES", "LUCID_FX_CHILDREN", "META_KEYS", "META_TYPES", "check_prepared_meta"]

# Every node.meta key lucid_fx writes: those named in lucid_fx/_meta.py (less the GraphModule.meta one).
META_KEYS = tuple(value for key, value in vars(_meta).items() if key.isupper() and isinstance(value, str)
                  and key not in _meta.NOT_NODE_KEYS + _meta.PROGRAM_KEYS)

_SCALARS = (type(None), bool, int, float, str)
_TORCH_DATA = (torch.dtype, torch.device, torch.memory_format, torch.layout)


def _meta_types() -> Dict[str, Any]:
    from lucid_fx.ops import CanonicalCall
    from lucid_fx._placement import Placement
    from lucid_fx.quantization.qconfig import QConfig
    from lucid_fx.rules.observers import Decision

    return {  # the type each node.meta key is documented with in lucid_fx/_meta.py
        _meta.OP: CanonicalCall,  # its arguments name other nodes by NodeRef (a field annotation: load checks it)
        _meta.INTERVAL: Tuple[float, float],  # (lo, hi)
        _meta.INTERVAL_RULE: str,
        _meta.FUSION: str,
        _meta.FUSED_INTO: str,
        _meta.DECISION: Decision,
        _meta.MEASURED: str,
        _meta.DYNAMIC: QConfig,
        _meta.MODULE_PATH: str,
        _meta.OBSERVER: str,
        _meta.TENSOR_META: Union[TensorMetadata, tuple, list, dict],  # ShapeProp nests it for several outputs
        _meta.WEIGHT_OBSERVER: str,
        _meta.BN_FOLDED: bool,
        _meta.BN_NOT_FOLDED: str,
        _meta.MUTATION: str,
        _meta.FOLDED_BN: str,
        _meta.PLACEMENT: Placement,
        _meta.ABSORBED: Dict[str, Placement],
        _meta.SOURCE: str,
        _meta.QPARAMS: Tuple[float, int, str],  # (scale, zero_point, grid name)
        _meta.LOWERING: str,
        _meta.OBSERVER_KIND: str,
        _meta.VALUE_TYPE: Tuple[Tuple[int, ...], torch.dtype],  # (shape, dtype)
    }


def _lucid_fx_attributes() -> Dict[str, Any]:
    from lucid_fx._placement import ConvertReport
    from lucid_fx.prepare import PrepareReport

    return {  # what lucid_fx sets on the model it returns, besides submodules and buffers
        "lucid_fx_report": PrepareReport,  # prepare
        "lucid_fx_convert_report": Union[ConvertReport, Dict[str, ConvertReport]],  # convert (one per graph)
    }


def _lucid_fx_children() -> Dict[str, type]:
    return {  # the containers lucid_fx adds to a prepared model: convert reads them as dicts
        OBSERVERS: nn.ModuleDict,
        WEIGHT_OBSERVERS: nn.ModuleDict,
    }


LUCID_FX_CHILDREN: Callable[[], Dict[str, type]] = functools.lru_cache(maxsize=None)(_lucid_fx_children)
META_TYPES: Callable[[], Dict[str, Any]] = functools.lru_cache(maxsize=None)(_meta_types)
LUCID_FX_ATTRIBUTES: Callable[[], Dict[str, Any]] = functools.lru_cache(maxsize=None)(_lucid_fx_attributes)


def check_data(value: Any, where: str, allowed: Callable[[Any], bool]) -> None:
    """A node argument: data and node references only (``allowed`` vouches for the caller's objects)."""
    if isinstance(value, (_SCALARS, _TORCH_DATA, fx.Node, torch.Size)) or value is Ellipsis:
        return
    if isinstance(value, (tuple, list)):
        for item in value:
            check_data(item, where, allowed)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_data(key, where, allowed)
            check_data(item, where, allowed)
    elif isinstance(value, slice):
        check_data((value.start, value.stop, value.step), where, allowed)
    elif not allowed(value):
        raise ValueError(f"{where}: an argument may only be data or a node, got {type(value).__name__} {value!r:.60}")


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> Dict[str, Any]:
    return typing.get_type_hints(cls)


def _is_factory(value: Any, allowed: Callable[[Any], bool]) -> bool:
    """A zero-argument factory as a QConfig holds one: an observer or fake-quant class, or such a
    class with arguments (``with_args``), or a function the caller allowed."""
    if isinstance(value, functools.partial):
        value = value.func
    return A.is_factory_class(value) or allowed(value)


def _is_record(value: Any) -> bool:
    return (dataclasses.is_dataclass(value) and not isinstance(value, type)) or (isinstance(value, tuple) and hasattr(value, "_fields"))


def conforms(value: Any, hint: Any, allowed: Callable[[Any], bool]) -> Optional[str]:
    """None if ``value`` has the annotated type ``hint``; else what it is instead. A dataclass or
    named tuple is also held to its own field annotations, wherever it sits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is object:
        return conforms(value, type(value), allowed) if _is_record(value) else None
    if hint is None or hint is type(None):
        return None if value is None else f"{type(value).__name__} where None belongs"
    if origin in (Union, types.UnionType):
        for arm in args:
            if conforms(value, arm, allowed) is None:
                return None
        return f"{type(value).__name__} where {hint} belongs"
    if origin is collections.abc.Callable:
        return None if _is_factory(value, allowed) else f"{value!r:.60} where an observer factory belongs"
    if origin in (tuple, list, set, frozenset):
        if not isinstance(value, origin):
            return f"{type(value).__name__} where a {origin.__name__} belongs"
        if origin is tuple and args and args[-1] is not Ellipsis:
            if len(value) != len(args):
                return f"a {len(value)}-tuple where a {len(args)}-tuple belongs"
            return next((p for p in map(conforms, value, args, [allowed] * len(args)) if p), None)
        return next((p for p in (conforms(v, args[0], allowed) for v in value) if p), None) if args else None
    if origin in (dict, collections.abc.Mapping):
        if not isinstance(value, dict):
            return f"{type(value).__name__} where a dict belongs"
        key, item = args or (Any, Any)
        return next((p for k, v in value.items() for p in (conforms(k, key, allowed), conforms(v, item, allowed)) if p), None)
    if not isinstance(hint, type):
        return None  # a TypeVar or a string annotation that did not resolve: no constraint
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return None  # an int stands for a float
    if not isinstance(value, hint) or (hint is int and isinstance(value, bool)):
        return f"{type(value).__name__} where {hint.__name__} belongs"
    if _is_record(value):
        for name, field_hint in _hints(type(value)).items():
            problem = conforms(getattr(value, name), field_hint, allowed)
            if problem:
                return f"{type(value).__name__}.{name}: {problem}"
    return None


def check_meta(key: str, value: Any, where: str, allowed: Callable[[Any], bool]) -> None:
    problem = conforms(value, META_TYPES().get(key, Any), allowed)
    if problem:
        raise ValueError(f"{where}: {problem}")


def _node_refs(call: Any) -> list:
    from lucid_fx.ops import NodeRef

    values = getattr(call, "args", {}).values()
    return [v for value in values for v in (value if isinstance(value, (list, tuple)) else (value,)) if isinstance(v, NodeRef)]


def check_prepared_meta(gm: fx.GraphModule, owner: str) -> None:
    """What convert reads in a prepared graph (one with observers) is there and points where it should."""
    names = {n.name: n for n in gm.graph.nodes}
    observers, weight_observers = (getattr(gm, OBSERVERS, {}), getattr(gm, WEIGHT_OBSERVERS, {}))
    before: set = set()
    for node in gm.graph.nodes:
        where, meta = f"node {node.name!r} ({node.op}) in {owner}: meta", node.meta
        observer_call = node.op == "call_module" and node.target.startswith(OBSERVERS + ".")
        if not observer_call and _meta.OP not in meta:  # canonicalize_ops gives every other node its op
            raise ValueError(f"{where} lacks {_meta.OP!r}")
        unknown = [r.name for r in _node_refs(meta.get(_meta.OP)) if r.name not in before]
        if unknown:  # the op's arguments name nodes the graph computes before this one
            raise ValueError(f"{where} {_meta.OP!r} names node {unknown[0]!r:.80}, which does not come before it in the graph")
        before.add(node.name)
        if (_meta.FUSION in meta) != (_meta.FUSED_INTO in meta):  # a fused group's members carry both
            raise ValueError(f"{where} has only one of {_meta.FUSION!r} and {_meta.FUSED_INTO!r}")
        end = names.get(meta[_meta.FUSED_INTO]) if _meta.FUSED_INTO in meta else None
        if _meta.FUSED_INTO in meta and (end is None or end.meta.get(_meta.FUSED_INTO) != end.name):  # the group's last member
            raise ValueError(f"{where} {_meta.FUSED_INTO!r} names {meta[_meta.FUSED_INTO]!r}, which ends no fused group")
        for key, table in ((_meta.OBSERVER, observers), (_meta.WEIGHT_OBSERVER, weight_observers)):
            if key in meta and meta[key] not in table:
                raise ValueError(f"{where} {key!r} names {meta[key]!r}, which is not among the model's observers")
