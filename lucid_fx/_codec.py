"""Values as data for :mod:`lucid_fx.save_load`: what ``torch.load(weights_only=True)`` can read.

Tensors, ``str``/``int``/``float``/``bool``/``None`` and lists stay as they are. Everything else
becomes a dict tagged ``"$"``: tuples, dicts, slices, torch dtypes/devices/memory formats, graph
node references, and references to classes and functions by qualified name. A name is resolved
on load only against the closed lists of :mod:`lucid_fx._allowlist` (never by importing what a
file names), plus the objects the caller passes as ``allow=``. Decoding a malformed value raises
``ValueError`` naming where it is; nesting deeper than ``MAX_DEPTH`` is malformed.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import re
from typing import Any, Callable, Dict, Iterable, Optional

import torch
from torch import fx

from lucid_fx import _allowlist as A
from lucid_fx._allowlist import NotSerializable
from lucid_fx.quantization.observers import _Factory

__all__ = ["Codec", "NotSerializable", "MAX_DEPTH"]

MAX_DEPTH = 32  # values lucid_fx writes nest 6 deep at most (a Decision's QConfig's factory's kwargs)
_OP_NAME = re.compile(r"torch\.ops(\.[A-Za-z_][A-Za-z0-9_]{0,60}){2,3}")  # torch.ops.mylib.squish(.default)
_TORCH_ENUMS = {"dtype": torch.dtype, "memory_format": torch.memory_format, "layout": torch.layout}


def _is_value_class(cls: type) -> bool:
    return A.class_name(cls) in A.value_class_names()


class Codec:
    """Encoder/decoder of values, with the caller's extra allowed classes and functions."""

    def __init__(self, allow: Iterable[Any] = ()) -> None:
        self.extra: Dict[str, Any] = {}
        for obj in allow:
            for name, each in A.allow_entries(obj):
                self._add(name, each)
        for obj in list(self.extra.values()):  # an op's packet, once every overload it may call is allowed
            if isinstance(obj, torch._ops.OpOverload) and all(self.allowed(o) for _, o in A.allow_entries(obj.overloadpacket)[1:]):
                self._add(A.op_name(obj.overloadpacket), obj.overloadpacket)
        # Files written before ops were named torch.ops.<ns>.<op> named them by their Python qualname.
        self.old_names = {f"{getattr(o, '__module__', '?')}.{getattr(o, '__qualname__', '?')}": o
                          for o in self.extra.values() if A.op_name(o) is not None}

    def _add(self, name: str, obj: Any) -> None:
        if name in self.extra and self.extra[name] is not obj:
            # Files name functions by qualified name: two under one name could be swapped.
            raise ValueError(f"allow= holds two different objects named {name!r} (lambdas or local functions?); give them distinct names")
        self.extra[name] = obj

    def allowed(self, obj: Any) -> bool:
        """Whether the caller passed ``obj`` in ``allow=``."""
        return any(obj is v for v in self.extra.values())

    # -- names ------------------------------------------------------------------------------
    def fn_name(self, fn: Any, where: str) -> str:
        for name, obj in self.extra.items():
            if obj is fn:
                return name
        name = A.fn_name(fn)
        if name is None:
            op = A.op_name(fn)
            raise NotSerializable(
                f"{where}: calls {op or getattr(fn, '__qualname__', fn)!r}, which is not on the allowlist of functions "
                "lucid_fx.save writes as data (torch.*, torch.nn.functional.*, torch.ops.lucid_fx.*, operator.*, math.*); "
                f"pass it as save(..., allow=[{op or 'fn'}]) and load(..., allow=[{op or 'fn'}])"
            )
        return name

    def fn(self, name: Any, where: str) -> Any:
        found = (self.extra.get(name) or self.old_names.get(name)) if isinstance(name, str) else None
        found = found if found is not None and not isinstance(found, type) else A.resolve_fn(name)
        if found is None:
            op = isinstance(name, str) and _OP_NAME.fullmatch(name)  # a file's string: named in the hint only if it is one
            raise ValueError(f"{where}: unknown function {name!r:.80}; if you trust it, pass it as load(..., allow=[{name if op else 'fn'}])")
        return found

    def class_name(self, cls: type, where: str, wanted: Callable[[type], bool] = A.is_module_class, what: str = "torch.nn and lucid_fx module classes") -> str:
        name = A.class_name(cls)
        if self.extra.get(name) is cls or A.resolve_class(name, wanted) is cls:
            return name
        raise NotSerializable(
            f"{where}: class {name} is not on the allowlist ({what}); if it keeps its state "
            "in parameters, buffers and plain attributes, pass it as save(..., allow=[cls]) and load(..., allow=[cls])"
        )

    def cls(self, name: Any, where: str, wanted: Callable[[type], bool] = A.is_module_class) -> type:
        found = self.extra.get(name) if isinstance(name, str) else None
        found = found if isinstance(found, type) else A.resolve_class(name, wanted)
        if found is None:
            raise ValueError(f"{where}: unknown class {name!r:.80}; if you trust it, pass it as load(..., allow=[cls])")
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
        data_class = lambda: self.class_name(type(value), where, _is_value_class, "lucid_fx's value classes")  # noqa: E731
        if isinstance(value, tuple) and hasattr(value, "_fields"):
            return {"$": "namedtuple", "cls": data_class(), "v": [enc(v) for v in value]}
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
        for kind, cls in _TORCH_ENUMS.items():
            if isinstance(value, cls):
                return {"$": kind, "v": str(value).rpartition(".")[2]}
        if isinstance(value, torch.device):
            return {"$": "device", "v": str(value)}
        if isinstance(value, enum.Enum):
            return {"$": "enum", "cls": data_class(), "v": enc(value.value)}
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            fields = {f.name: enc(getattr(value, f.name)) for f in dataclasses.fields(value)}
            return {"$": "dataclass", "cls": data_class(), "v": fields}
        if isinstance(value, functools.partial) and type(value) in (functools.partial, _Factory):
            return {"$": "partial", "factory": type(value) is _Factory, "fn": enc(value.func), "args": enc(value.args), "kw": enc(value.keywords)}
        if isinstance(value, torch.nn.Module):
            raise NotSerializable(f"{where}: a module held outside the module tree ({type(value).__qualname__})")
        if isinstance(value, type):
            return {"$": "class", "v": self.class_name(value, where, A.is_factory_class, "observer and fake-quant classes")}
        if callable(value):
            return {"$": "fn", "v": self.fn_name(value, where)}
        raise NotSerializable(f"{where}: cannot write a {type(value).__qualname__} as data ({value!r:.80})")

    def decode(self, data: Any, where: str, nodes: Optional[Dict[str, fx.Node]] = None, depth: int = 0) -> Any:
        if depth > MAX_DEPTH:
            raise ValueError(f"{where}: a value nested more than {MAX_DEPTH} deep")
        dec = lambda v: self.decode(v, where, nodes, depth + 1)  # noqa: E731
        if data is None or isinstance(data, (bool, int, float, str, torch.Tensor)):
            return data
        if isinstance(data, list):
            return [dec(v) for v in data]
        if not isinstance(data, dict) or not isinstance(data.get("$"), str):
            raise ValueError(f"{where}: malformed value in the file ({type(data).__name__})")
        tag, v = data["$"], data.get("v")
        decoder = _DECODERS.get(tag)
        if decoder is None:
            raise ValueError(f"{where}: unknown value tag {tag!r:.40}")
        expected = _SHAPES[tag]
        if set(data) != expected[0] or not all(isinstance(data[k], t) for k, t in expected[1].items()):
            raise ValueError(f"{where}: malformed {tag!r} value (keys {sorted(map(str, data))})")
        return decoder(self, data, v, dec, where, nodes)


def _node(codec: Codec, data, v, dec, where, nodes):
    if nodes is None or data["name"] not in nodes:
        raise ValueError(f"{where}: reference to unknown node {data['name']!r:.80}")
    return nodes[data["name"]]


def _pairs(codec: Codec, data, v, dec, where, nodes):
    if not all(isinstance(p, list) and len(p) == 2 for p in v):
        raise ValueError(f"{where}: malformed 'dict' value: entries must be [key, value] pairs")
    pairs = [(dec(k), dec(x)) for k, x in v]
    if not all(isinstance(k, (str, int, float, bool, type(None), torch.dtype)) for k, _ in pairs):
        raise ValueError(f"{where}: malformed 'dict' value: a key is not a string or number")
    return dict(pairs)


def _slice(codec: Codec, data, v, dec, where, nodes):
    parts = [dec(x) for x in v]
    if len(parts) != 3 or not all(p is None or isinstance(p, (int, fx.Node)) for p in parts):
        raise ValueError(f"{where}: malformed 'slice' value")
    return slice(*parts)


def _size(codec: Codec, data, v, dec, where, nodes):
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in v):
        raise ValueError(f"{where}: malformed 'size' value {v!r:.80}")
    return torch.Size(v)


def _device(codec: Codec, data, v, dec, where, nodes):
    try:
        return torch.device(v)
    except (RuntimeError, ValueError):
        raise ValueError(f"{where}: unknown device {v!r:.40}") from None


def _torch_enum(codec: Codec, data, v, dec, where, nodes):
    value = getattr(torch, v, None) if v.isidentifier() else None
    if not isinstance(value, _TORCH_ENUMS[data["$"]]):
        raise ValueError(f"{where}: unknown torch {data['$']} {v!r:.40}")
    return value


def _construct(codec: Codec, data, v, dec, where, nodes):
    """An enum, named tuple or dataclass of the value classes, built by its own constructor
    (which validates it: QDtype checks its grid)."""
    tag, name = data["$"], data["cls"]
    cls = codec.cls(name, where, _is_value_class)
    kind_ok = {"enum": issubclass(cls, enum.Enum), "namedtuple": issubclass(cls, tuple) and hasattr(cls, "_fields"),
               "dataclass": dataclasses.is_dataclass(cls) and not issubclass(cls, enum.Enum)}[tag]
    if not kind_ok:
        raise ValueError(f"{where}: {name} is not a{'n' if tag[0] == 'e' else ''} {tag}")
    try:
        if tag == "enum":
            return cls(dec(v))
        if tag == "namedtuple":
            return cls(*dec(v))
        fields = {k: dec(x) for k, x in v.items()}
        known = {f.name: f for f in dataclasses.fields(cls)}
        # a field added since the file was written (with a default) may be absent, nothing else
        defaulted = {k for k, f in known.items() if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}
        if not set(fields) <= set(known) or not set(known) - set(fields) <= defaulted:
            raise ValueError(f"fields {sorted(map(str, fields))}, expected {sorted(known)}")
        obj = cls(**{k: x for k, x in fields.items() if known[k].init})
        for k, x in fields.items():
            if not known[k].init:
                object.__setattr__(obj, k, x)
        return obj
    except (TypeError, ValueError) as err:
        if str(err).startswith(where):
            raise
        raise ValueError(f"{where}: malformed {name.rpartition('.')[2]} {tag}: {err}") from None


def _class(codec: Codec, data, v, dec, where, nodes):
    return codec.cls(v, where, A.is_factory_class)


def _partial(codec: Codec, data, v, dec, where, nodes):
    """A factory: an observer or fake-quant class (or an allowed function) with data arguments."""
    fn, args, kw = dec(data["fn"]), dec(data["args"]), dec(data["kw"])
    if not (A.is_factory_class(fn) or codec.allowed(fn)):
        raise ValueError(f"{where}: a factory must build an observer or fake quant, got {fn!r:.80}")
    if not (isinstance(args, tuple) and isinstance(kw, dict) and all(isinstance(k, str) and k.isidentifier() for k in kw)):
        raise ValueError(f"{where}: malformed factory arguments")
    return (_Factory if data["factory"] else functools.partial)(fn, *args, **kw)


_any = object
# tag -> (its keys, the type of each typed key); then the decoder of each tag
_SHAPES = {
    "node": ({"$", "name"}, {"name": str}),
    "size": ({"$", "v"}, {"v": list}),
    "tuple": ({"$", "v"}, {"v": list}),
    "dict": ({"$", "v"}, {"v": list}),
    "set": ({"$", "v"}, {"v": list}),
    "slice": ({"$", "v"}, {"v": list}),
    "ellipsis": ({"$"}, {}),
    "dtype": ({"$", "v"}, {"v": str}),
    "memory_format": ({"$", "v"}, {"v": str}),
    "layout": ({"$", "v"}, {"v": str}),
    "device": ({"$", "v"}, {"v": str}),
    "enum": ({"$", "cls", "v"}, {"cls": str}),
    "namedtuple": ({"$", "cls", "v"}, {"cls": str, "v": list}),
    "dataclass": ({"$", "cls", "v"}, {"cls": str, "v": dict}),
    "class": ({"$", "v"}, {"v": str}),
    "fn": ({"$", "v"}, {"v": str}),
    "partial": ({"$", "factory", "fn", "args", "kw"}, {"factory": bool}),
}


def _set(codec: Codec, data, v, dec, where, nodes):
    items = [dec(x) for x in v]
    if not all(isinstance(x, (str, int, float, bool, type(None))) for x in items):
        raise ValueError(f"{where}: malformed 'set' value: an element is not a string or number")
    return set(items)


_DECODERS = {
    "node": _node, "size": _size, "tuple": lambda c, d, v, dec, w, n: tuple(dec(x) for x in v), "dict": _pairs,
    "set": _set, "slice": _slice, "ellipsis": lambda *_: Ellipsis,
    "dtype": _torch_enum, "memory_format": _torch_enum, "layout": _torch_enum, "device": _device,
    "enum": _construct, "namedtuple": _construct, "dataclass": _construct, "class": _class,
    "fn": lambda c, d, v, dec, w, n: c.fn(v, w), "partial": _partial,
}
