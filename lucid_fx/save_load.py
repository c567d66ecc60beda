"""save / load: prepared and converted models as data, loaded without running pickled code.

The file is one ``torch.save`` of plain containers and tensors, so ``torch.load(weights_only=True)``
reads it. A module is written as its class's qualified name (torch.nn and lucid_fx classes, or
ones the caller allows), its plain attributes (what ``nn.Module.__setstate__`` would restore),
its parameters and buffers, and its children. A ``GraphModule`` is written as its graph: a node
list of op kind, target (a function by qualified name, resolved on load against an allowlist),
and arguments with node references; for a prepared graph, also the ``node.meta`` entries that
calibrating and converting read, for a converted one those that inspection reads. Caches (oneDNN-packed weights) are not module state: they are
rebuilt on the first call.
"""

from __future__ import annotations

import dataclasses
import inspect
import keyword
import os
import re
from typing import Any, Dict, Iterable, Tuple, Union

import torch
from torch import fx, nn

from lucid_fx import _meta, _parametrized
from lucid_fx._codec import Codec, NotSerializable, check_tensor_method
from lucid_fx.passes.insert_observers import OBSERVERS

__all__ = ["save", "load", "FORMAT", "FORMAT_VERSION"]

FORMAT = "lucid_fx.save"
FORMAT_VERSION = 1
_MODULE_STATE = frozenset(nn.Module().__dict__)
_GRAPH_MODULE_STATE = frozenset(fx.GraphModule(nn.Module(), fx.Graph()).__dict__)
_META_KEYS = tuple(value for key, value in vars(_meta).items() if key.isupper() and isinstance(value, str))
_INSPECTION_KEYS = (
    _meta.SOURCE, _meta.QPARAMS, _meta.LOWERING, _meta.OBSERVER_KIND, _meta.VALUE_TYPE, _meta.DECISION,
    _meta.INTERVAL, _meta.INTERVAL_RULE, _meta.MODULE_PATH, _meta.TENSOR_META, _meta.PLACEMENT,
)
# What getattr may read in a loaded graph: torch.Tensor's data attributes (x.shape, x.dtype, ...).
_TENSOR_ATTRIBUTES = frozenset(
    n for n in dir(torch.Tensor) if not n.startswith("_") and not callable(getattr(torch.Tensor, n, None)) and n != "grad_fn"
)
_OPS = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")
_ATTR = re.compile(r"[A-Za-z0-9_]+")  # Sequential children are named "0", "1", ...
_PLACEHOLDER = re.compile(r"\*{0,2}[A-Za-z_][A-Za-z0-9_]*")


def _where(path: str) -> str:
    return f"module {path!r}" if path else "the root module"


# -- writing ---------------------------------------------------------------------------------
def _encode_meta(node: fx.Node, codec: Codec, where: str, keys: Tuple[str, ...], strict: bool) -> Dict[str, Any]:
    meta = {}
    for key in keys:
        if key not in node.meta:
            continue
        value = node.meta[key]
        try:
            meta[key] = codec.encode(value, f"{where}, meta {key!r}", node_ok=True)
        except NotSerializable:
            if not strict:
                continue  # inspection data only: a value that is not plain data is left out
            if key != _meta.DECISION or getattr(value, "qconfig", None) is None:
                raise
            # The QConfig only told prepare which observers to build; a custom factory that
            # cannot be written as data is dropped, the decision itself is kept.
            meta[key] = codec.encode(dataclasses.replace(value, qconfig=None), where, node_ok=True)
    return meta


def _encode_graph(gm: fx.GraphModule, path: str, codec: Codec) -> Dict[str, Any]:
    if type(gm.graph._codegen) is not fx.graph.CodeGen:
        raise NotSerializable(f"{_where(path)}: its graph has a {type(gm.graph._codegen).__name__} (pytree inputs/outputs), which lucid_fx.save cannot write")
    # A prepared graph keeps every key (convert reads them); a converted one what to_networkx,
    # visualize and `lucid-fx show` read: sources, grids, lowerings, decisions, shapes.
    prepared = hasattr(gm, OBSERVERS)
    keys = _META_KEYS if prepared else _INSPECTION_KEYS
    nodes = []
    for node in gm.graph.nodes:
        where = f"node {node.name!r} ({node.op}) in {_where(path)}"
        target: Any = node.target
        if node.op == "call_function":
            target = {"$": "fn", "v": codec.fn_name(node.target, where)}
        elif node.op == "call_method":
            check_tensor_method(node.target, where)
        record = {
            "name": node.name, "op": node.op, "target": target,
            "args": codec.encode(node.args, where, node_ok=True),
            "kwargs": codec.encode(dict(node.kwargs), where, node_ok=True),
            "tensor_type": node.type is torch.Tensor,
        }
        record["meta"] = _encode_meta(node, codec, where, keys, strict=prepared)
        nodes.append(record)
    return {"nodes": nodes}


def _encode_module(module: nn.Module, path: str, codec: Codec, seen: Dict[int, str]) -> Dict[str, Any]:
    if id(module) in seen:
        return {"kind": "alias", "path": seen[id(module)]}
    seen[id(module)] = path
    where = _where(path)
    for key, value in module.__dict__.items():
        if "hook" in key and isinstance(value, (dict, list)) and value:
            raise NotSerializable(f"{where} ({type(module).__name__}) has {key} registered; hooks are code, which "
                                  "lucid_fx.save does not write: remove them before saving and add them again after loading")
    is_graph = isinstance(module, fx.GraphModule)
    state = _GRAPH_MODULE_STATE if is_graph else _MODULE_STATE
    record: Dict[str, Any] = {"kind": "graph" if is_graph else "module", "training": module.training}
    if is_graph:
        record["class_name"] = type(module).__name__
    else:
        record["class"] = codec.class_name(_parametrized.base_class(module), f"{where} ({type(module).__name__})")
    record["attrs"] = {k: codec.encode(v, f"{where}, attribute {k!r}") for k, v in module.__dict__.items() if k not in state}
    record["params"] = {k: None if p is None else p.detach() for k, p in module._parameters.items()}
    record["requires_grad"] = {k: p.requires_grad for k, p in module._parameters.items() if p is not None}
    record["buffers"] = dict(module._buffers)
    record["non_persistent"] = sorted(module._non_persistent_buffers_set)
    parametrized = not is_graph and _parametrized.base_class(module) is not type(module)
    record["children"] = [
        [name, None if child is None else _encode_module(child, f"{path}.{name}" if path else name, codec, seen)]
        for name, child in module._modules.items()
        if not (parametrized and name == _parametrized.CONTAINER)
    ]
    if parametrized:  # after the children, as load reads them: a module shared with the subtree is built once
        record["parametrized"] = _parametrized.encode(module, path, lambda m, p: _encode_module(m, p, codec, seen))
    if is_graph:
        record["graph"] = _encode_graph(module, path, codec)
    return record


def save(model: nn.Module, path: Union[str, os.PathLike, Any], *, allow: Iterable[Any] = ()) -> None:
    """Write a prepared (even mid-calibration) or converted model to ``path`` as data.

    Args:
        model: a model from :func:`lucid_fx.prepare` or :func:`lucid_fx.convert` (or any module
            tree of torch.nn and lucid_fx modules and GraphModules).
        path: a file name or a writable binary file object.
        allow: extra classes (their state must be parameters, buffers and plain attributes) and
            functions the graph calls, beyond the built-in allowlist; pass the same to :func:`load`.

    Raises:
        TypeError (``NotSerializable``) naming the module, node or attribute that cannot be
        written as data, and what to do.

    Example:
        >>> import io, torch, lucid_fx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
        >>> prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4),))
        >>> _ = lucid_fx.calibrate(prepared, [torch.randn(2, 4) for _ in range(3)], progress=False)
        >>> buffer = io.BytesIO()
        >>> lucid_fx.save(lucid_fx.convert(prepared), buffer)
        >>> _ = buffer.seek(0)
        >>> loaded = lucid_fx.load(buffer)
        >>> x = torch.randn(2, 4)
        >>> torch.equal(loaded(x), lucid_fx.convert(prepared)(x))
        True
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"lucid_fx.save expects an nn.Module, got {type(model).__name__}")
    codec = Codec(allow)
    payload = {"format": FORMAT, "version": FORMAT_VERSION, "torch": str(torch.__version__), "model": _encode_module(model, "", codec, {})}
    torch.save(payload, path)


# -- reading ---------------------------------------------------------------------------------
def _check_path(gm: nn.Module, target: Any, op: str, where: str) -> None:
    """A get_attr/call_module target walks only the module tree: submodules, parameters, buffers
    and tensor attributes, never a method, a class or a function's globals."""
    if not (isinstance(target, str) and all(_ATTR.fullmatch(p) and not p.startswith("__") for p in target.split("."))):
        raise ValueError(f"{where}: malformed {op} target {target!r}")
    value: Any = gm
    for part in target.split("."):
        found = None
        if isinstance(value, nn.Module):
            for table in (value._modules, value._parameters, value._buffers):
                if part in table:
                    found = table[part]
                    break
            else:
                plain = value.__dict__.get(part)
                found = plain if isinstance(plain, (torch.Tensor, nn.Module)) else None
        if found is None:
            raise ValueError(f"{where}: {op} target {target!r} is not a submodule, parameter, buffer or tensor of the loaded module")
        value = found
    if op == "call_module" and not isinstance(value, nn.Module):
        raise ValueError(f"{where}: call_module target {target!r} is not a module")


def _decode_graph(data: Dict[str, Any], gm: fx.GraphModule, codec: Codec, path: str) -> fx.Graph:
    graph, nodes = fx.Graph(), {}
    for record in data["nodes"]:
        op, target, name = record.get("op"), record.get("target"), record.get("name")
        where = f"node {name!r} ({op}) in {_where(path)}"
        if op not in _OPS or not isinstance(name, str):
            raise ValueError(f"{where}: unknown node kind {op!r}")
        if op == "call_function":
            if not (isinstance(target, dict) and target.get("$") == "fn"):
                raise ValueError(f"{where}: a call_function target must be a function on the allowlist, got {target!r:.80}")
            target = codec.decode(target, where)
        elif op == "call_method":
            check_tensor_method(target, where)
        elif op in ("get_attr", "call_module"):
            _check_path(gm, target, op, where)
        elif op == "placeholder" and not (isinstance(target, str) and _PLACEHOLDER.fullmatch(target)):
            raise ValueError(f"{where}: malformed placeholder name {target!r}")
        elif op == "output" and target != "output":
            raise ValueError(f"{where}: malformed output node")
        args, kwargs = codec.decode(record["args"], where, nodes), codec.decode(record["kwargs"], where, nodes)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise ValueError(f"{where}: malformed arguments")
        if any(not (isinstance(k, str) and k.isidentifier()) or keyword.iskeyword(k) for k in kwargs):
            raise ValueError(f"{where}: keyword argument names must be identifiers, got {list(kwargs)!r:.80}")
        if target is getattr and not (len(args) == 2 and args[1] in _TENSOR_ATTRIBUTES):
            raise ValueError(f"{where}: getattr is allowed only for tensor attributes (shape, dtype, ...), got {args[1:]!r}")
        if op == "call_function" and kwargs and getattr(target, "__module__", None) == "builtins" and target is not getattr:
            raise ValueError(f"{where}: {target.__name__}() takes no keyword arguments from a file")
        node = graph.create_node(op, target, args, kwargs, name=name, type_expr=torch.Tensor if record.get("tensor_type") else None)
        nodes[name] = node
    for record, node in zip(data["nodes"], graph.nodes):
        for key, value in record.get("meta", {}).items():
            if key in _META_KEYS:
                node.meta[key] = codec.decode(value, f"node {node.name!r}, meta {key!r}", nodes)
    graph.lint()
    return graph


def _shadows_code(cls: type, key: str) -> bool:
    """An instance attribute that would stand in for code: a dunder, a method or property of the
    class, or a hook torch calls by name (a parametrization's ``right_inverse``)."""
    if key.startswith("__") or key in ("right_inverse",):
        return True
    static = inspect.getattr_static(cls, key, None)
    return callable(static) or isinstance(static, (property, staticmethod, classmethod))


def _decode_module(record: Dict[str, Any], path: str, codec: Codec, built: Dict[str, nn.Module]) -> nn.Module:
    where = _where(path)
    kind = record.get("kind")
    if kind == "alias":
        return built[record["path"]]
    if kind == "graph":
        class_name = record.get("class_name")
        if not (isinstance(class_name, str) and class_name.isidentifier()):
            raise ValueError(f"{where}: malformed GraphModule class name {class_name!r}")
        module: nn.Module = fx.GraphModule(nn.Module(), fx.Graph(), class_name=class_name)
        state = _GRAPH_MODULE_STATE
    elif kind == "module":
        cls = codec.cls(record.get("class"), where)
        if not issubclass(cls, nn.Module) or issubclass(cls, fx.GraphModule):
            raise ValueError(f"{where}: {record.get('class')} is not a module class")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        state = _MODULE_STATE
    else:
        raise ValueError(f"{where}: unknown record kind {kind!r}")
    built[path] = module
    module.training = bool(record["training"])
    for name, child in record["children"]:
        child_path = f"{path}.{name}" if path else name
        module._modules[name] = None if child is None else _decode_module(child, child_path, codec, built)
    for name, tensor in record["params"].items():
        module._parameters[name] = None if tensor is None else nn.Parameter(tensor, requires_grad=record["requires_grad"][name])
    module._buffers.update(record["buffers"])
    module._non_persistent_buffers_set.update(record["non_persistent"])
    for key, value in record["attrs"].items():
        if not (isinstance(key, str) and key.isidentifier()) or key in state or _shadows_code(type(module), key):
            raise ValueError(f"{where}: attribute {key!r} may not be set from a file")
        module.__dict__[key] = codec.decode(value, f"{where}, attribute {key!r}")
    if kind == "module" and "parametrized" in record:
        _parametrized.decode(module, record["parametrized"], path, lambda r, p: _decode_module(r, p, codec, built))
    if kind == "graph":
        module.graph = _decode_graph(record["graph"], module, codec, path)
    return module


def load(path: Union[str, os.PathLike, Any], *, map_location: Any = None, allow: Iterable[Any] = ()) -> nn.Module:
    """Read a model written by :func:`save`; no pickled code runs (``torch.load(weights_only=True)``),
    and classes and functions resolve only against the allowlist and ``allow``.

    Args:
        path: a file name or a readable binary file object.
        map_location: as for ``torch.load`` (``"cpu"``, ``"cuda"``, a device, ...).
        allow: the extra classes and functions given to :func:`save`, if any.

    Example:
        >>> import lucid_fx
        >>> lucid_fx.load("no/such/model.pt")
        Traceback (most recent call last):
        ...
        FileNotFoundError: lucid_fx.load: no/such/model.pt does not exist
    """
    name = os.fspath(path) if isinstance(path, (str, os.PathLike)) else repr(path)
    if isinstance(path, (str, os.PathLike)) and not os.path.exists(path):
        raise FileNotFoundError(f"lucid_fx.load: {name} does not exist")
    expected = f"a {FORMAT!r} file, format version {FORMAT_VERSION}"
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:  # any malformed file: torch.load raises many kinds (KeyError, EOFError, ...)
        lines = [line.strip() for line in str(err).splitlines() if line.strip()] or [type(err).__name__]
        first = next((line for line in lines if "Unsupported" in line or "WeightsUnpickler" in line), lines[0])
        raise ValueError(f"lucid_fx.load: {name} is not {expected} written by lucid_fx.save; "
                         f"torch.load(weights_only=True) refused it: {first}") from None
    if not (isinstance(payload, dict) and payload.get("format") == FORMAT):
        raise ValueError(f"lucid_fx.load: {name} was not written by lucid_fx.save (expected {expected})")
    if payload.get("version") != FORMAT_VERSION:
        raise ValueError(f"lucid_fx.load: {name} has format version {payload.get('version')!r}; this lucid_fx reads version {FORMAT_VERSION}")
    return _decode_module(payload["model"], "", Codec(allow), {})
