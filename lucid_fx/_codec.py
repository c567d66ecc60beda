"""Values as data for :mod:`lucid_fx.save_load`: what ``torch.load(weights_only=True)`` can read.

Tensors, ``str``/``int``/``float``/``bool``/``None`` and lists stay as they are. Everything else
becomes a dict tagged ``"$"``: tuples, dicts, slices, torch dtypes/devices/memory formats, graph
node references, and references to classes and functions by qualified name. A name is resolved
on load only against the allowlist below (never by importing what a file names), plus the
objects the caller passes as ``allow=``.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import operator
import types
from typing import Any, Callable, Dict, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx.quantization.observers import _Factory

__all__ = ["Codec", "NotSerializable"]


class NotSerializable(TypeError):
    """A value, function or class that lucid_fx.save cannot write as data."""


# Functions a graph may call: pure tensor math. torch.* is limited to ATen's public tensor
# functions (torch._C._VariableFunctions: no torch.save/load, nothing private), minus the ones
# that read files or set global state.
_ATEN_FUNCTIONS = frozenset(n for n in dir(torch._C._VariableFunctions) if not n.startswith("_"))
_TORCH_DENY = frozenset({"from_file", "load", "save", "manual_seed", "seed", "set_flush_denormal"})


def _torch_function_ok(name: str, fn: Any) -> bool:
    if name == "_assert" or getattr(fn, "__module__", "") == "torch.functional":
        return True
    return _c_function(fn) and name in _ATEN_FUNCTIONS and name not in _TORCH_DENY and not name.startswith("set_")
_OPERATORS = frozenset(
    "add sub mul truediv floordiv mod pow matmul neg pos abs invert and_ or_ xor lshift rshift getitem "
    "eq ne lt le gt ge not_ iadd isub imul itruediv".split()
)
_BUILTINS = {f.__name__: f for f in (getattr, len, min, max, abs, int, float, bool, round)}
_TENSOR_METHOD_DENY = frozenset({"apply_", "map_", "map2_", "register_hook", "register_post_accumulate_grad_hook"})


def _c_function(fn: Any) -> bool:
    return isinstance(fn, types.BuiltinFunctionType)


# namespace -> (object, "may a graph call this attribute?")
_NAMESPACES: Dict[str, tuple] = {
    "torch": (torch, lambda n, f: _torch_function_ok(n, f)),
    "torch.nn.functional": (F, lambda n, f: not n.startswith("_") and (getattr(f, "__module__", "") in ("torch.nn.functional", "torch._C._nn") or _c_function(f))),
    "torch.special": (torch.special, lambda n, f: _c_function(f) and not n.startswith("_")),
    "torch.linalg": (torch.linalg, lambda n, f: _c_function(f) and not n.startswith("_")),
    "torch.fft": (torch.fft, lambda n, f: _c_function(f) and not n.startswith("_")),
    "math": (math, lambda n, f: _c_function(f) and not n.startswith("_")),
    "operator": (operator, lambda n, f: n in _OPERATORS),
    "builtins": (types.SimpleNamespace(**_BUILTINS), lambda n, f: True),
}
_OP_NAMESPACES = ("lucid_fx",)  # torch.ops.<ns>.*: aten has from_file, _print, manual_seed
_CLASS_PREFIXES = ("torch.nn.modules.", "lucid_fx.")  # module, dataclass and enum classes
_EXTRA_CLASSES = {"torch.fx.passes.shape_prop.TensorMetadata"}


def check_tensor_method(name: str, where: str) -> None:
    if not (isinstance(name, str) and name.isidentifier() and not name.startswith("_")
            and hasattr(torch.Tensor, name) and name not in _TENSOR_METHOD_DENY):
        raise NotSerializable(f"{where}: method {name!r} is not a public torch.Tensor method on the allowlist")


def _fn_name(fn: Any) -> Optional[str]:
    if isinstance(fn, torch._ops.OpOverloadPacket):
        return "torch.ops." + fn._qualified_op_name.replace("::", ".")
    if isinstance(fn, torch._ops.OpOverload):
        return f"torch.ops.{fn._schema.name.replace('::', '.')}.{fn._overloadname}"
    name = getattr(fn, "__name__", None)
    for prefix, (space, ok) in _NAMESPACES.items():
        if isinstance(name, str) and getattr(space, name, None) is fn and ok(name, fn):
            return f"{prefix}.{name}"
    return None


def _resolve_fn(name: str) -> Any:
    if name.startswith("torch.ops."):
        parts = name.split(".")[2:]
        if len(parts) in (2, 3) and parts[0] in _OP_NAMESPACES and all(p.isidentifier() for p in parts):
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


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _resolve_class(name: str) -> Optional[type]:
    if not (name.startswith(_CLASS_PREFIXES) or name in _EXTRA_CLASSES):
        return None
    import importlib

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
        # Only a class defined under that name: not one reached through a module's imports
        # (lucid_fx.layout.subprocess.Popen is subprocess.Popen, which is not allowed).
        return value if isinstance(value, type) and _class_name(value) == name else None
    return None


class Codec:
    """Encoder/decoder of values, with the caller's extra allowed classes and functions."""

    def __init__(self, allow: Iterable[Any] = ()) -> None:
        self.extra: Dict[str, Any] = {}
        for obj in allow:
            name = _class_name(obj) if isinstance(obj, type) else f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"
            if name in self.extra and self.extra[name] is not obj:
                # Files name functions by qualified name: two under one name could be swapped.
                raise ValueError(f"allow= holds two different objects named {name!r} (lambdas or local functions?); give them distinct names")
            self.extra[name] = obj

    # -- names ------------------------------------------------------------------------------
    def fn_name(self, fn: Any, where: str) -> str:
        for name, obj in self.extra.items():
            if obj is fn:
                return name
        name = _fn_name(fn)
        if name is None or _resolve_fn(name) is not fn:
            raise NotSerializable(
                f"{where}: calls {getattr(fn, '__qualname__', fn)!r}, which is not on the allowlist of functions "
                "lucid_fx.save writes as data (torch.*, torch.nn.functional.*, torch.ops.lucid_fx.*, operator.*, math.*); "
                "pass it as save(..., allow=[fn]) and load(..., allow=[fn])"
            )
        return name

    def fn(self, name: str, where: str) -> Any:
        found = self.extra.get(name)
        found = found if found is not None and not isinstance(found, type) else _resolve_fn(name)
        if found is None:
            raise NotSerializable(f"{where}: unknown function {name!r}; if you trust it, pass it as load(..., allow=[fn])")
        return found

    def class_name(self, cls: type, where: str) -> str:
        name = _class_name(cls)
        if self.extra.get(name) is cls or _resolve_class(name) is cls:
            return name
        raise NotSerializable(
            f"{where}: class {name} is not on the allowlist (torch.nn and lucid_fx classes); if it keeps its state "
            "in parameters, buffers and plain attributes, pass it as save(..., allow=[cls]) and load(..., allow=[cls])"
        )

    def cls(self, name: str, where: str) -> type:
        found = self.extra.get(name)
        found = found if isinstance(found, type) else _resolve_class(name)
        if found is None:
            raise NotSerializable(f"{where}: unknown class {name!r}; if you trust it, pass it as load(..., allow=[cls])")
        return found

    # -- values -----------------------------------------------------------------------------
    def encode(self, value: Any, where: str, node_ok: bool = False) -> Any:
        enc = lambda v: self.encode(v, where, node_ok)  # noqa: E731
        if value is None or isinstance(value, (bool, int, float, str, torch.Tensor)):
            return value
        if isinstance(value, fx.Node):
            if not node_ok:
                raise NotSerializable(f"{where}: a graph node outside a graph")
            return {"$": "node", "name": value.name}
        if isinstance(value, torch.Size):
            return {"$": "size", "v": list(value)}
        if isinstance(value, list):
            return [enc(v) for v in value]
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return {"$": "namedtuple", "cls": self.class_name(type(value), where), "v": [enc(v) for v in value]}
        if isinstance(value, tuple):
            return {"$": "tuple", "v": [enc(v) for v in value]}
        if isinstance(value, dict):
            return {"$": "dict", "v": [[enc(k), enc(v)] for k, v in value.items()]}
        if isinstance(value, (set, frozenset)):
            return {"$": "set", "v": [enc(v) for v in sorted(value, key=repr)]}
        if isinstance(value, slice):
            return {"$": "slice", "v": [enc(value.start), enc(value.stop), enc(value.step)]}
        if value is Ellipsis:
            return {"$": "ellipsis"}
        for kind, cls in (("dtype", torch.dtype), ("memory_format", torch.memory_format), ("layout", torch.layout)):
            if isinstance(value, cls):
                return {"$": kind, "v": str(value).rpartition(".")[2]}
        if isinstance(value, torch.device):
            return {"$": "device", "v": str(value)}
        if isinstance(value, enum.Enum):
            return {"$": "enum", "cls": self.class_name(type(value), where), "v": enc(value.value)}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: enc(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return {"$": "dataclass", "cls": self.class_name(type(value), where), "v": fields}
        if isinstance(value, functools.partial) and type(value) in (functools.partial, _Factory):
            return {"$": "partial", "factory": type(value) is _Factory, "fn": enc(value.func), "args": enc(value.args), "kw": enc(value.keywords)}
        if isinstance(value, torch.nn.Module):
            raise NotSerializable(f"{where}: a module held outside the module tree ({type(value).__qualname__})")
        if isinstance(value, type):
            return {"$": "class", "v": self.class_name(value, where)}
        if callable(value):
            return {"$": "fn", "v": self.fn_name(value, where)}
        raise NotSerializable(f"{where}: cannot write a {type(value).__qualname__} as data ({value!r:.80})")

    def decode(self, data: Any, where: str, nodes: Optional[Dict[str, fx.Node]] = None) -> Any:
        dec = lambda v: self.decode(v, where, nodes)  # noqa: E731
        if data is None or isinstance(data, (bool, int, float, str, torch.Tensor)):
            return data
        if isinstance(data, list):
            return [dec(v) for v in data]
        if not isinstance(data, dict) or not isinstance(data.get("$"), str):
            raise ValueError(f"{where}: malformed value in the file ({type(data).__name__})")
        tag, v = data["$"], data.get("v")
        if tag == "node":
            if nodes is None or data["name"] not in nodes:
                raise ValueError(f"{where}: reference to unknown node {data.get('name')!r}")
            return nodes[data["name"]]
        simple = {
            "size": lambda: torch.Size(v), "tuple": lambda: tuple(dec(x) for x in v), "ellipsis": lambda: Ellipsis,
            "dict": lambda: {dec(k): dec(x) for k, x in v}, "set": lambda: {dec(x) for x in v},
            "slice": lambda: slice(*(dec(x) for x in v)), "device": lambda: torch.device(v),
            "class": lambda: self.cls(v, where), "fn": lambda: self.fn(v, where),
        }
        if tag in simple:
            return simple[tag]()
        if tag in ("dtype", "memory_format", "layout"):
            value = getattr(torch, v, None) if isinstance(v, str) else None
            if not isinstance(value, {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}[tag]):
                raise ValueError(f"{where}: unknown torch {tag} {v!r}")
            return value
        if tag in ("enum", "namedtuple"):
            cls = self.cls(data["cls"], where)
            if tag == "enum" and issubclass(cls, enum.Enum):
                return cls(dec(v))
            if tag == "namedtuple" and issubclass(cls, tuple) and hasattr(cls, "_fields"):
                return cls(*dec(v))
            raise ValueError(f"{where}: {data['cls']} is not a{'n enum' if tag == 'enum' else ' named tuple'}")
        if tag == "dataclass":
            cls = self.cls(data["cls"], where)
            if not dataclasses.is_dataclass(cls):
                raise ValueError(f"{where}: {data['cls']} is not a dataclass")
            fields = {k: dec(x) for k, x in v.items()}
            init = {f.name for f in dataclasses.fields(cls) if f.init}
            obj = cls(**{k: x for k, x in fields.items() if k in init})
            for k, x in fields.items():
                if k not in init:
                    object.__setattr__(obj, k, x)
            return obj
        if tag == "partial":
            fn = dec(data["fn"])
            return (_Factory if data.get("factory") else functools.partial)(fn, *dec(data["args"]), **dec(data["kw"]))
        raise ValueError(f"{where}: unknown value tag {tag!r}")
