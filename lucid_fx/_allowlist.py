"""The closed lists a saved file chooses from: functions, tensor methods and classes.

A file names things by qualified name; :mod:`lucid_fx.save_load` resolves a name only against
these lists (never by importing what a file names), plus the objects the caller passes as
``allow=``. Everything here is decided by the installed torch and lucid_fx, not by a file.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import importlib
import math
import operator
import types
import typing
from typing import Any, Callable, Dict, FrozenSet, Optional

import torch
import torch.nn.functional as F

__all__ = [
    "NotSerializable", "resolve_fn", "fn_name", "op_name", "allow_entries", "resolve_class", "class_name", "is_module_class", "is_factory_class",
    "value_class_names", "MOVED_CLASSES", "TENSOR_METHODS", "TENSOR_ATTRIBUTES", "BUILTINS",
]


class NotSerializable(TypeError):
    """A value, function or class that lucid_fx.save cannot write as data (off these lists)."""


# -- functions a graph may call ----------------------------------------------------------------
# torch.* is limited to ATen's public tensor functions (torch._C._VariableFunctions: no
# torch.save/load, nothing private), minus the ones that read files or set global state.
_ATEN_FUNCTIONS = frozenset(n for n in dir(torch._C._VariableFunctions) if not n.startswith("_"))
_TORCH_DENY = frozenset({"from_file", "load", "save", "manual_seed", "seed", "set_flush_denormal"})
_OPERATORS = frozenset(
    "add sub mul truediv floordiv mod pow matmul neg pos abs invert and_ or_ xor lshift rshift getitem "
    "eq ne lt le gt ge not_ iadd isub imul itruediv".split()
)
BUILTINS = {f.__name__: f for f in (getattr, len, min, max, abs, int, float, bool, round)}


def _c_function(fn: Any) -> bool:
    return isinstance(fn, types.BuiltinFunctionType)


def _torch_function_ok(name: str, fn: Any) -> bool:
    if name == "_assert" or getattr(fn, "__module__", "") == "torch.functional":
        return True
    return _c_function(fn) and name in _ATEN_FUNCTIONS and name not in _TORCH_DENY and not name.startswith("set_")


# namespace -> (object, "may a graph call this attribute?")
_NAMESPACES: Dict[str, tuple] = {
    "torch": (torch, _torch_function_ok),
    "torch.nn.functional": (F, lambda n, f: not n.startswith("_") and (getattr(f, "__module__", "") in ("torch.nn.functional", "torch._C._nn") or _c_function(f))),
    "torch.special": (torch.special, lambda n, f: _c_function(f) and not n.startswith("_")),
    "torch.linalg": (torch.linalg, lambda n, f: _c_function(f) and not n.startswith("_")),
    "torch.fft": (torch.fft, lambda n, f: _c_function(f) and not n.startswith("_")),
    "math": (math, lambda n, f: _c_function(f) and not n.startswith("_")),
    "operator": (operator, lambda n, f: n in _OPERATORS),
    "builtins": (types.SimpleNamespace(**BUILTINS), lambda n, f: True),
}
_OP_NAMESPACES = ("lucid_fx",)  # torch.ops.<ns>.*: aten has from_file, _print, manual_seed


def op_name(fn: Any) -> Optional[str]:
    """How Python spells a torch.library op: ``torch.ops.mylib.squish`` for its packet,
    ``torch.ops.mylib.squish.default`` for an overload; None for anything else. (An op's
    ``__qualname__`` is pybind11's, not a name anyone can look up.)"""
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return "torch.ops." + fn._qualified_op_name.replace("::", ".")
    if isinstance(fn, torch._ops.OpOverload):
        return f"torch.ops.{fn._schema.name.replace('::', '.')}.{fn._overloadname}"
    return None


def _overloads(packet: Any) -> list:
    found = []
    for overload in packet.overloads():
        try:
            found.append(getattr(packet, overload))
        except (AttributeError, RuntimeError):
            continue  # an overload torch lists but cannot build (a schema it no longer takes)
    return found


def allow_entries(obj: Any) -> list:
    """The (name, object) pairs an ``allow=`` entry stands for: an op's packet stands for its
    overloads too, as a graph (``symbolic_trace``, ``torch.export``) may call either."""
    if isinstance(obj, type):
        return [(class_name(obj), obj)]
    name = op_name(obj)
    if name is None:
        return [(f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}", obj)]
    overloads = _overloads(obj) if isinstance(obj, torch._ops.OpOverloadPacket) else []
    return [(name, obj)] + [(op_name(o), o) for o in overloads]


def fn_name(fn: Any) -> Optional[str]:
    """The qualified name of an allowlisted function, or None."""
    name = op_name(fn)
    if name is None:
        short = getattr(fn, "__name__", None)
        name = next((f"{prefix}.{short}" for prefix, (space, ok) in _NAMESPACES.items()
                     if isinstance(short, str) and getattr(space, short, None) is fn and ok(short, fn)), None)
    return name if name is not None and resolve_fn(name) is fn else None


def resolve_fn(name: str) -> Any:
    """The allowlisted function called ``name``, or None."""
    if not isinstance(name, str):
        return None
    if name.startswith("torch.ops."):
        parts = name.split(".")[2:]
        if len(parts) in (2, 3) and parts[0] in _OP_NAMESPACES and all(p.isidentifier() and not p.startswith("_") for p in parts):
            try:
                found = getattr(getattr(torch.ops, parts[0]), parts[1])
                return getattr(found, parts[2]) if len(parts) == 3 else found
            except (AttributeError, RuntimeError):
                return None
        return None
    prefix, _, attr = name.rpartition(".")
    if prefix in _NAMESPACES and attr.isidentifier():
        space, ok = _NAMESPACES[prefix]
        fn = getattr(space, attr, None)
        return fn if fn is not None and ok(attr, fn) else None
    return None


# -- tensor methods and attributes -------------------------------------------------------------
# Public torch.Tensor methods, less those that take code (a callable) or reach outside the tensor.
_METHOD_DENY = frozenset({
    "apply_", "map_", "map2_",  # call a Python callable on every element
    "register_hook", "register_post_accumulate_grad_hook",  # store a callable to run later
    "backward",  # runs autograd hooks registered elsewhere
    "share_memory_",  # creates shared memory (a file under /dev/shm)
})
_PUBLIC = [n for n in dir(torch.Tensor) if not n.startswith("_")]
TENSOR_METHODS: FrozenSet[str] = frozenset(n for n in _PUBLIC if callable(getattr(torch.Tensor, n, None)) and n not in _METHOD_DENY)
# What getattr may read in a loaded graph: torch.Tensor's data attributes (x.shape, x.dtype, ...).
TENSOR_ATTRIBUTES: FrozenSet[str] = frozenset(
    n for n in _PUBLIC if not callable(getattr(torch.Tensor, n, None)) and n != "grad_fn"
)

# -- classes -----------------------------------------------------------------------------------
_MODULE_PREFIXES = ("torch.nn.modules.", "lucid_fx.")


def class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.lru_cache(maxsize=1024)  # a pure function of the install; a name is any string, so bounded
def _find_class(name: str) -> Optional[type]:
    """The class defined under ``name`` in torch or lucid_fx: not one reached through a module's
    imports (lucid_fx.layout.subprocess.Popen is subprocess.Popen, which is not allowed)."""
    if not (isinstance(name, str) and name.startswith(("torch.", "lucid_fx."))):
        return None
    parts = name.split(".")
    if not all(p.isidentifier() and not p.startswith("__") for p in parts):
        return None
    for i in range(len(parts) - 1, 0, -1):  # longest importable module prefix, then attributes
        try:  # only lucid_fx and torch modules get here, never a module a file names freely
            value: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for part in parts[i:]:
            value = getattr(value, part, None)
        return value if isinstance(value, type) and class_name(value) == name else None
    return None


def is_module_class(cls: Any) -> bool:
    """A torch.nn or lucid_fx module class (not a GraphModule: those are written as graphs)."""
    return (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and not issubclass(cls, torch.fx.GraphModule)
            and class_name(cls).startswith(_MODULE_PREFIXES))


def is_factory_class(cls: Any) -> bool:
    """An observer or fake-quant class: what a QConfig's factories build."""
    from lucid_fx.quantization.fake_quantize import FakeQuantize
    from lucid_fx.quantization.observers import ObserverBase

    return (isinstance(cls, type) and issubclass(cls, (ObserverBase, FakeQuantize))
            and class_name(cls).startswith("lucid_fx."))


# The values lucid_fx writes as dataclasses, enums and named tuples: node.meta values, reports,
# observer attributes. The classes their fields are annotated with are added below.
_VALUE_ROOTS = (
    "lucid_fx.quantization.dtypes.QDtype",  # observers' grid
    "lucid_fx.quantization.dtypes.QScheme",  # observers' scheme
    "lucid_fx.quantization.dtypes.QParams",  # a grid with its scale and zero point
    "lucid_fx.quantization.qconfig.QConfig",  # inside a Decision, on a prepared graph
    "lucid_fx.rules.observers.Decision",  # node.meta[DECISION]
    "lucid_fx.node_refs.CanonicalCall",  # node.meta[OP]
    "lucid_fx.prepare.PrepareReport",  # the prepared root's lucid_fx_report
    "lucid_fx._placement.ConvertReport",  # the converted root's lucid_fx_convert_report
    "torch.fx.passes.shape_prop.TensorMetadata",  # node.meta["tensor_meta"]
)


def _annotated_classes(cls: type) -> list:
    """Dataclasses, enums and named tuples named in the field annotations of ``cls``."""
    found: list = []

    def visit(hint: Any) -> None:
        if isinstance(hint, type) and (dataclasses.is_dataclass(hint) or issubclass(hint, enum.Enum)
                                       or (issubclass(hint, tuple) and hasattr(hint, "_fields"))):
            found.append(hint)
        for arg in typing.get_args(hint):
            visit(arg)

    for hint in typing.get_type_hints(cls).values():
        visit(hint)
    return found


def _value_classes() -> FrozenSet[str]:
    names, todo = set(), [_find_class(n) for n in _VALUE_ROOTS]
    while todo:
        cls = todo.pop()
        if cls is not None and class_name(cls) not in names:
            names.add(class_name(cls))
            if not issubclass(cls, enum.Enum):
                todo += _annotated_classes(cls)
    return frozenset(names)


@functools.lru_cache(maxsize=None)
def value_class_names() -> FrozenSet[str]:
    """Qualified names of the value classes (computed on first use: it imports lucid_fx modules)."""
    return _value_classes()


# Classes that moved since files were written: a file names a class where it was defined when it
# was saved, so load looks an old name up where the class lives now (issue 12 moved these into
# their layers). Only moves within lucid_fx, from one fixed name to another.
MOVED_CLASSES = {
    "lucid_fx.passes.lowering_context.ConvertReport": "lucid_fx._placement.ConvertReport",
    "lucid_fx.placement.Placement": "lucid_fx._placement.Placement",
    "lucid_fx.placement.Runs": "lucid_fx._placement.Runs",
    "lucid_fx.quantization.dynamic.DynamicQuantizedLinear": "lucid_fx.dynamic.DynamicQuantizedLinear",
    "lucid_fx.ops.CanonicalCall": "lucid_fx.node_refs.CanonicalCall",  # beside BoundCall since 2026-12-03
}


def resolve_class(name: str, wanted: Callable[[type], bool]) -> Optional[type]:
    """The class called ``name`` (or once called so: :data:`MOVED_CLASSES`) if ``wanted(cls)``:
    module classes, factory classes or value classes."""
    cls = _find_class(MOVED_CLASSES.get(name, name) if isinstance(name, str) else name)
    return cls if cls is not None and wanted(cls) else None
