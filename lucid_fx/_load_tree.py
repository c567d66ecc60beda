"""Reading the module tree of a saved file: each record checked before anything is built from it.

What a record may hold is in :mod:`lucid_fx._load_modules` (module state against the class's
twin), :mod:`lucid_fx._load_graph` (nodes) and :mod:`lucid_fx._load_values` (values by place).
"""

from __future__ import annotations

from typing import Any, Dict

from torch import fx, nn

from lucid_fx import _load_modules as M
from lucid_fx import _parametrized
from lucid_fx._codec import Codec
from lucid_fx._load_graph import decode_graph
from lucid_fx._load_values import LUCID_FX_ATTRIBUTES, LUCID_FX_CHILDREN, check_prepared_meta, conforms
from lucid_fx._meta import OBSERVERS

__all__ = ["decode_module", "where_is", "MAX_MODULE_DEPTH"]

MAX_MODULE_DEPTH = 100  # module nesting; real models nest about 10 deep


def where_is(path: str) -> str:
    return f"module {path!r}" if path else "the root module"


def _tensors(record: Dict[str, Any], where: str) -> Dict[str, Any]:
    """The record's parameters and buffers (and parametrized originals, as written), checked."""
    params, grads, buffers = record["params"], record["requires_grad"], record["buffers"]
    if set(grads) != {k for k, p in params.items() if p is not None} or not all(isinstance(g, bool) for g in grads.values()):
        raise ValueError(f"{where}: requires_grad does not match the parameters")
    if set(params) & set(buffers) or not all(isinstance(n, str) and n in buffers for n in record["non_persistent"]):
        raise ValueError(f"{where}: a name is both a parameter and a buffer, or a non-persistent name is no buffer")
    for name, tensor in [*params.items(), *buffers.items()]:
        if tensor is not None:
            M.check_tensor(tensor, f"{where}, tensor {name!r:.60}")
            if grads.get(name) and not (tensor.is_floating_point() or tensor.is_complex()):
                raise ValueError(f"{where}: tensor {name!r} requires grad but is {tensor.dtype}")
    originals = {k: r.get("original") for k, r in record.get("parametrized", {}).items() if isinstance(r, dict)}
    for name, tensor in originals.items():
        M.check_tensor(tensor, f"{where}, parametrized tensor {name!r:.60}")
    return {**params, **buffers, **originals}


def _check_own_attributes(attrs: Dict[str, Any], codec: Codec, graph: bool, where: str) -> Dict[str, Any]:
    """Checks the attributes lucid_fx sets on the modules it returns (reports, and fx's tensor
    constants on a GraphModule); returns the others, which the module's class must keep."""
    rest = {}
    for key, value in attrs.items():
        hint = LUCID_FX_ATTRIBUTES().get(key)
        problem = conforms(value, hint, codec.allowed) if hint is not None else None
        if problem:
            raise ValueError(f"{where}: attribute {key!r} is {problem}")
        if hint is None and graph and isinstance(key, str) and M.TENSOR_CONSTANT.fullmatch(key):
            M.check_tensor(value, f"{where}, attribute {key!r}")
        elif hint is None and graph:
            raise ValueError(f"{where}: attribute {key!r:.60} may not be set from a file (lucid_fx does not set it on a GraphModule)")
        elif hint is None:
            rest[key] = value
    return rest


def decode_module(record: Any, path: str, codec: Codec, built: Dict[str, nn.Module], depth: int = 0) -> nn.Module:
    where = where_is(path)
    if depth > MAX_MODULE_DEPTH:
        raise ValueError(f"{where}: modules nested more than {MAX_MODULE_DEPTH} deep")
    kind = M.check_record(record, where)
    if kind == "alias":  # a module met earlier, never one of its own ancestors (a cycle)
        target = record["path"]
        if target not in built or target == "" or path.startswith(target + "."):
            raise ValueError(f"{where}: alias of {target!r:.60}, which is not a module loaded before it")
        return built[target]
    if kind == "graph":
        if not record["class_name"].isidentifier():
            raise ValueError(f"{where}: malformed GraphModule class name {record['class_name']!r:.60}")
        cls: type = fx.GraphModule
        module: nn.Module = fx.GraphModule(nn.Module(), fx.Graph(), class_name=record["class_name"])
    else:
        cls = codec.cls(record["class"], where)
        module = cls.__new__(cls)
        nn.Module.__init__(module)
    where = f"{where} ({record['class_name'] if kind == 'graph' else cls.__name__})"
    built[path] = module
    module.training = record["training"]
    for pair in record["children"]:
        if not (isinstance(pair, list) and len(pair) == 2) or pair[0] == _parametrized.CONTAINER:
            raise ValueError(f"{where}: malformed child entry {pair!r:.60}")
        name = M.check_name(pair[0], where, "child", cls)
        child_path = f"{path}.{name}" if path else name
        child = None if pair[1] is None else decode_module(pair[1], child_path, codec, built, depth + 1)
        if name in LUCID_FX_CHILDREN() and type(child) is not LUCID_FX_CHILDREN()[name]:
            raise ValueError(f"{where}: child {name!r} is a {type(child).__name__}; lucid_fx makes it a {LUCID_FX_CHILDREN()[name].__name__}")
        module._modules[name] = child
    tensors = _tensors(record, where)
    if set(module._modules) & set(tensors):
        raise ValueError(f"{where}: {sorted(set(module._modules) & set(tensors))[0]!r} names both a child and a tensor")
    for name, tensor in record["params"].items():
        M.check_name(name, where, "parameter", cls)
        module._parameters[name] = None if tensor is None else nn.Parameter(tensor, requires_grad=record["requires_grad"][name])
    for name, tensor in record["buffers"].items():
        module._buffers[M.check_name(name, where, "buffer", cls)] = tensor
    module._non_persistent_buffers_set.update(record["non_persistent"])
    attrs = {k: codec.decode(v, f"{where}, attribute {k!r:.60}") for k, v in record["attrs"].items()}
    M.check_tensors_in(list(attrs.values()), f"{where}, an attribute")
    rest, twin = _check_own_attributes(attrs, codec, kind == "graph", where), None
    if kind == "module":
        twin = M.build_twin(cls, rest, tensors, where)
        M.check_attribute_names(cls, rest, twin, M.MODULE_STATE, where)
        M.check_attribute_values(cls, rest, twin, where)
    module.__dict__.update(attrs)
    if "parametrized" in record:
        _parametrized.decode(module, record["parametrized"], path, lambda r, p: decode_module(r, p, codec, built, depth + 1))
        tensors.update({name: chain.original for name, chain in getattr(module, _parametrized.CONTAINER, {}).items()})
    M.check_state(module, twin, tensors, where)
    M.own_resizable_state(module, twin)
    if kind == "graph":
        module.graph = decode_graph(record["graph"], module, codec, path)
        if OBSERVERS in module._modules:
            check_prepared_meta(module, where_is(path))
    return module
