"""What a module record may hold, checked against what save writes for its class.

A file may set on a module only what lucid_fx itself writes there: for a torch.nn or lucid_fx
class, the attributes, parameters, buffers and children of its *twin*, the module its own
constructor builds (on the meta device: no memory, no computation) from the file's attribute
values; for a GraphModule, the reports lucid_fx sets and fx's tensor constants. Attributes keep
their twin's types, tensors their twin's dtype and shape. A class the caller allows
(``allow=``) has no twin: its attributes are limited to the names its own code assigns.
"""

from __future__ import annotations

import dis
import functools
import inspect
import re
import types
import warnings
from typing import Any, Dict, FrozenSet, Optional

import torch
from torch import fx, nn

from lucid_fx import _allowlist as A

__all__ = ["MODULE_STATE", "GRAPH_MODULE_STATE", "check_record", "check_name", "check_tensor", "check_tensors_in", "build_twin",
           "check_attribute_names", "check_attribute_values", "check_state", "own_resizable_state"]

MODULE_STATE = frozenset(nn.Module().__dict__)
GRAPH_MODULE_STATE = frozenset(fx.GraphModule(nn.Module(), fx.Graph()).__dict__)
_COMMON = {"kind": str, "training": bool, "attrs": dict, "params": dict, "requires_grad": dict,
           "buffers": dict, "non_persistent": list, "children": list}
# record kind -> (required keys and their types, optional keys and their types)
_RECORDS = {
    "module": ({**_COMMON, "class": str}, {"parametrized": dict}),
    "graph": ({**_COMMON, "class_name": str, "graph": dict}, {}),
    "alias": ({"kind": str, "path": str}, {}),
}
_NAME = re.compile(r"[A-Za-z0-9_]+")  # Sequential children are named "0", "1", ...
TENSOR_CONSTANT = re.compile(r"_tensor_constant\d+")  # what fx names a tensor a traced forward creates


def check_record(record: Any, where: str) -> str:
    """The record's kind, once its keys and their types are what save writes."""
    kind = record.get("kind") if isinstance(record, dict) else None
    if not isinstance(kind, str) or kind not in _RECORDS:
        raise ValueError(f"{where}: malformed module record (kind {kind!r:.40})")
    required, optional = _RECORDS[kind]
    for key in record:
        if key not in required and key not in optional:
            raise ValueError(f"{where}: unexpected key {key!r:.40} in a {kind} record")
    for key, typ in {**required, **optional}.items():
        if key in required and key not in record:
            raise ValueError(f"{where}: the {kind} record lacks {key!r}")
        if key in record and not isinstance(record[key], typ):
            raise ValueError(f"{where}: {key!r} is a {type(record[key]).__name__}, expected {typ.__name__}")
    return kind


def check_name(name: Any, where: str, what: str, cls: type) -> str:
    """A name a module is given a child, parameter or buffer by: as ``register_buffer`` and
    ``add_module`` would accept it, and not hiding anything the class defines."""
    if not (isinstance(name, str) and _NAME.fullmatch(name) and not name.startswith("__")):
        raise ValueError(f"{where}: malformed {what} name {name!r:.60}")
    if inspect.getattr_static(cls, name, None) is not None or name in MODULE_STATE:
        raise ValueError(f"{where}: {what} name {name!r} would hide {cls.__name__}.{name}")
    return name


def check_tensors_in(value: Any, where: str) -> None:
    """Every tensor inside an attribute value, as :func:`check_tensor`."""
    if isinstance(value, torch.Tensor):
        check_tensor(value, where)
    for item in value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ():
        check_tensors_in(item, where)


def check_tensor(value: Any, where: str) -> torch.Tensor:
    """A tensor as save writes one: dense, on a real device, not a quantized dtype."""
    if type(value) not in (torch.Tensor, nn.Parameter):
        raise ValueError(f"{where}: expected a tensor, got {type(value).__name__}")
    if value.layout != torch.strided or value.is_quantized or value.device.type == "meta":
        raise ValueError(f"{where}: a {value.layout} {value.dtype} tensor on {value.device}; save writes dense "
                         "tensors of plain dtypes on a real device")
    return value


@functools.lru_cache(maxsize=None)
def stored_names(cls: type) -> FrozenSet[str]:
    """The attribute names the class's own code (its methods, below nn.Module) assigns."""
    def stores(code: types.CodeType) -> set:
        found = {i.argval for i in dis.get_instructions(code) if i.opname == "STORE_ATTR"}
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                found |= stores(const)
        return found

    names: set = set()
    for klass in cls.__mro__:
        if klass is nn.Module or not issubclass(klass, nn.Module):
            continue
        for value in vars(klass).values():
            funcs = (value.fget, value.fset) if isinstance(value, property) else (getattr(value, "__func__", value),)
            for fn in funcs:
                if isinstance(getattr(fn, "__code__", None), types.CodeType):
                    names |= stores(fn.__code__)
    return frozenset(names)


def _shadows_code(cls: type, key: str) -> bool:
    """A name the class defines as code (a method, property or other descriptor)."""
    static = inspect.getattr_static(cls, key, None)
    return key.startswith("__") or key == "right_inverse" or callable(static) or hasattr(type(static), "__get__")


def build_twin(cls: type, attrs: Dict[str, Any], tensors: Dict[str, Optional[torch.Tensor]], where: str) -> Optional[nn.Module]:
    """What ``cls``'s constructor makes of the file's attributes, on the meta device; None for a
    class the caller allowed, or one whose constructor needs what a file does not hold."""
    if not A.is_module_class(cls):
        return None
    try:
        params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    except (TypeError, ValueError):
        return None
    kwargs: Dict[str, Any] = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.name in attrs:
            kwargs[p.name] = attrs[p.name]
        elif p.name in tensors and isinstance(p.default, bool):  # Linear(bias=...): whether the tensor is there
            kwargs[p.name] = tensors[p.name] is not None
        elif isinstance(tensors.get(p.name), torch.Tensor) and tensors[p.name].dim() == 0:  # a scalar kept as a buffer
            kwargs[p.name] = tensors[p.name].item()
        elif p.default is p.empty:
            if p.name in stored_names(cls):
                raise ValueError(f"{where}: the file lacks attribute {p.name!r}, which {cls.__name__} is built from")
            return None
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")  # a constructor's advice is for whoever built the original
            return cls(**kwargs)
    except (TypeError, ValueError, RuntimeError, AssertionError, AttributeError, KeyError, IndexError, OverflowError, ZeroDivisionError) as err:
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{where}: its attributes do not make a {cls.__name__}: {first}") from None


def check_attribute_names(cls: type, attrs: Dict[str, Any], twin: Optional[nn.Module], state: FrozenSet[str], where: str) -> None:
    allowed = set(twin.__dict__) - state if twin is not None else stored_names(cls)
    for key in attrs:
        if not (isinstance(key, str) and key.isidentifier()) or key in state or _shadows_code(cls, key) or key not in allowed:
            raise ValueError(f"{where}: attribute {key!r:.60} may not be set from a file ({cls.__name__} does not keep it)")
    missing = sorted(allowed - set(attrs)) if twin is not None else []
    if missing:
        raise ValueError(f"{where}: the file lacks attribute {missing[0]!r} of {cls.__name__}")


def _kind_problem(value: Any, ref: Any) -> Optional[str]:
    if ref is None:
        return None  # the twin leaves it unset: any data the decoder accepted
    if type(value) is not type(ref):
        return f"{type(value).__name__} where {type(ref).__name__} belongs"
    if isinstance(value, (tuple, list)):
        if len(value) != len(ref):
            return f"{len(value)} items where {len(ref)} belong"
        return next((p for p in map(_kind_problem, value, ref) if p), None)
    return None


def check_attribute_values(cls: type, attrs: Dict[str, Any], twin: Optional[nn.Module], where: str) -> None:
    """An attribute the constructor took must come back as the constructor keeps it; any other
    attribute must have the twin's type."""
    if twin is None:
        return
    built_from = set(inspect.signature(cls.__init__).parameters)
    for key, value in attrs.items():
        ref = twin.__dict__[key]
        problem = _kind_problem(value, ref)
        if problem is None and key in built_from and not _equal(value, ref):
            problem = f"{value!r:.40}, which {cls.__name__}(...) keeps as {ref!r:.40}"
        if problem:
            raise ValueError(f"{where}: attribute {key!r} is {problem}")


def _equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - a value whose == raises is not the one the constructor keeps
        return False


def _resizable(ref: torch.Tensor) -> bool:
    """State sized by the data it sees (per-tensor or per-channel qparams, per-channel ranges):
    the class resizes it in place."""
    return ref.numel() == 0 or ref.shape == (1,)


def own_resizable_state(module: nn.Module, twin: Optional[nn.Module]) -> None:
    """Give the buffers the class resizes storage of their own: a tensor read from a file cannot
    grow (measured: a QAT model saved before its first step failed its first step after load)."""
    for name, ref in (twin._buffers.items() if twin is not None else ()):
        got = module._buffers.get(name)
        if ref is not None and got is not None and _resizable(ref):
            module._buffers[name] = got.clone()


def check_state(module: nn.Module, twin: Optional[nn.Module], tensors: Dict[str, Optional[torch.Tensor]], where: str) -> None:
    """The module's tensors (parameters, buffers, parametrized originals) and children against the twin's."""
    if twin is None:
        return
    expected = {**twin._parameters, **twin._buffers}
    for name in sorted(set(expected) - set(tensors)):  # more is fine: a buffer anyone registered
        raise ValueError(f"{where}: lacks tensor {name!r} of {type(twin).__name__}")
    for name, ref in expected.items():
        got = tensors[name]
        if (got is None) != (ref is None):
            raise ValueError(f"{where}: tensor {name!r} is {'missing' if got is None else 'present'}, which its attributes do not allow")
        if got is None:
            continue
        if (name in twin._parameters) != (name in module._parameters or name in getattr(module, "parametrizations", {})):
            raise ValueError(f"{where}: {name!r} is a {'parameter' if name in twin._parameters else 'buffer'} of {type(twin).__name__}")
        resizable = _resizable(ref) and got.dim() <= 1
        if got.dtype != ref.dtype or not (resizable or got.shape == ref.shape):
            raise ValueError(f"{where}: tensor {name!r} is {got.dtype} {list(got.shape)}; {type(twin).__name__} holds "
                             f"{ref.dtype} {list(ref.shape)} there")
    grown = {name: tuple(tensors[name].shape) for name, ref in twin._buffers.items() if ref is not None and _resizable(ref)}
    if len(set(grown.values())) > 1:  # sized by the same data, together (a scale and its zero point)
        raise ValueError(f"{where}: tensors {sorted(grown)} must have one shape, got {sorted(grown.items())}")
    for name, ref_child in twin._modules.items():
        child = module._modules.get(name)
        common = set(type(ref_child).__mro__) & set(type(child).__mro__) - set(nn.Module.__mro__)
        if child is None or not common:
            raise ValueError(f"{where}: child {name!r} must be a module like {type(ref_child).__name__}, got {type(child).__name__}")
