"""save / load: prepared and converted models as data; a file chooses values, never code.

The file is one ``torch.save`` of plain containers and tensors, so ``torch.load(weights_only=True)``
reads it. A module is written as its class's qualified name (torch.nn and lucid_fx classes, or
ones the caller allows), its plain attributes (what ``nn.Module.__setstate__`` would restore),
its parameters and buffers, and its children. A ``GraphModule`` is written as its graph: a node
list of op kind, target (a function by qualified name) and arguments with node references; for
a prepared graph, also the ``node.meta`` entries that calibrating and converting read, for a
converted one those that inspection reads. Caches (oneDNN-packed weights) are not module state:
they are rebuilt on the first call.

Load takes from a file only what save writes (docs/policies.md, "The save format's threat
model"): names resolve against closed lists (:mod:`lucid_fx._allowlist`), each module is held
to what its class's constructor makes of the file's attributes (:mod:`lucid_fx._load_modules`),
every node of every kind to a closed list of targets and data arguments, each int8 call's scales,
zero points and ranges to what convert writes (:mod:`lucid_fx._load_qparams`), and each graph
must run on the meta device to the shapes it records (:mod:`lucid_fx._load_graph`). Anything else is a
``ValueError`` naming the module, node or key.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from typing import Any, Dict, Iterable, Tuple, Union

import torch
from torch import fx, nn

from lucid_fx import _allowlist, _meta, _parametrized
from lucid_fx._meta import ATTRIBUTES, OBSERVERS
from lucid_fx import _load_modules as M
from lucid_fx._activation_qparams import BUFFER as ACTIVATION_QPARAMS
from lucid_fx._activation_qparams import attach_guard, without_guard
from lucid_fx.program import RUNTIME_ATTRIBUTES, install_programs, runs_int8_kernels
from lucid_fx._codec import Codec, NotSerializable
from lucid_fx._load_graph import check_runs
from lucid_fx._load_qparams import check_qparams
from lucid_fx._pytree_spec import SPEC_ATTRIBUTES, encode_codegen, has_pytree_codegen
from lucid_fx._load_tree import decode_module, where_is
from lucid_fx._load_values import LUCID_FX_ATTRIBUTES, META_KEYS

__all__ = ["save", "load", "FORMAT", "FORMAT_VERSION"]

FORMAT = "lucid_fx.save"
FORMAT_VERSION = 1
_INSPECTION_KEYS = (
    _meta.SOURCE, _meta.QPARAMS, _meta.LOWERING, _meta.OBSERVER_KIND, _meta.VALUE_TYPE, _meta.DECISION,
    _meta.INTERVAL, _meta.INTERVAL_RULE, _meta.MODULE_PATH, _meta.TENSOR_META, _meta.PLACEMENT, _meta.ABSORBED,
)


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
    specs = encode_codegen(gm, where_is(path))
    # A prepared graph keeps every key (convert reads them); a converted one what to_networkx,
    # visualize and `lucid-fx show` read: sources, grids, lowerings, decisions, shapes.
    prepared = hasattr(gm, OBSERVERS)
    keys = META_KEYS if prepared else _INSPECTION_KEYS
    nodes = []
    for node in gm.graph.nodes:
        where = f"node {node.name!r} ({node.op}) in {where_is(path)}"
        target: Any = node.target
        if node.op == "call_function":
            target = {"$": "fn", "v": codec.fn_name(node.target, where)}
        elif node.op == "call_method" and node.target not in _allowlist.TENSOR_METHODS:
            raise NotSerializable(f"{where}: method {node.target!r} is not a public torch.Tensor method on the allowlist")
        record = {
            "name": node.name, "op": node.op, "target": target,
            "args": codec.encode(node.args, where, node_ok=True),
            "kwargs": codec.encode(dict(node.kwargs), where, node_ok=True),
            "tensor_type": node.type is torch.Tensor,
        }
        record["meta"] = _encode_meta(node, codec, where, keys, strict=prepared)
        value = functools.reduce(getattr, node.target.split("."), gm) if node.op == "get_attr" else None
        if isinstance(value, torch.Tensor):  # load checks the tensor it finds against this
            record["value_type"] = [list(value.shape), str(value.dtype)]
        nodes.append(record)
    return {"nodes": nodes} if specs is None else {"nodes": nodes, "pytree": specs}


def _copied(module: nn.Module) -> Dict[str, Any]:
    """Attributes prepare copied onto a nested graph from the module it replaced (``stride``), for a
    parent's forward to read (lucid_fx/_fallback.py): not saved, as load sets none on a GraphModule."""
    return module.meta.get(ATTRIBUTES, {}) if isinstance(module, fx.GraphModule) else {}


def _check_attributes_load_takes(module: nn.Module, where: str) -> None:
    """Save writes only the attributes load takes back: those lucid_fx sets, and those the class keeps."""
    own = set(LUCID_FX_ATTRIBUTES()) | (SPEC_ATTRIBUTES if has_pytree_codegen(module) else set())
    if isinstance(module, fx.GraphModule):
        extra = [k for k in module.__dict__ if k not in M.GRAPH_MODULE_STATE and k not in own and k not in RUNTIME_ATTRIBUTES
                 and not M.TENSOR_CONSTANT.fullmatch(k) and k not in _copied(module)]
        problem = f"attribute {extra[0]!r} may not be set from a file (lucid_fx does not set it on a GraphModule)" if extra else None
    else:
        cls = _parametrized.base_class(module)
        attrs = {k: v for k, v in module.__dict__.items() if k not in M.MODULE_STATE and k not in own}
        originals = {k: c.original for k, c in getattr(module, _parametrized.CONTAINER, {}).items()} if cls is not type(module) else {}
        try:
            twin = M.build_twin(cls, attrs, {**module._parameters, **module._buffers, **originals}, where)
            M.check_attribute_names(cls, attrs, twin, M.MODULE_STATE, where)
            problem = None
        except ValueError as err:
            problem = str(err).removeprefix(f"{where}: ")
    if problem:
        raise NotSerializable(f"{where} ({type(module).__name__}): {problem}; lucid_fx.load would refuse it, so save does "
                              "too: keep such data in a buffer (register_buffer) or delete it before saving")


def _encode_module(module: nn.Module, path: str, codec: Codec, seen: Dict[int, str]) -> Dict[str, Any]:
    if id(module) in seen:
        return {"kind": "alias", "path": seen[id(module)]}
    seen[id(module)] = path
    where = where_is(path)
    for key, value in module.__dict__.items():
        if "hook" in key and isinstance(value, (dict, list)) and without_guard(value):
            raise NotSerializable(f"{where} ({type(module).__name__}) has {key} registered; hooks are code, which "
                                  "lucid_fx.save does not write: remove them before saving and add them again after loading")
    _check_attributes_load_takes(module, where)
    is_graph = isinstance(module, fx.GraphModule)
    state = M.GRAPH_MODULE_STATE if is_graph else M.MODULE_STATE
    record: Dict[str, Any] = {"kind": "graph" if is_graph else "module", "training": module.training}
    if is_graph:
        record["class_name"] = type(module).__name__
    else:
        record["class"] = codec.class_name(_parametrized.base_class(module), f"{where} ({type(module).__name__})")
    record["attrs"] = {k: codec.encode(v, f"{where}, attribute {k!r}") for k, v in module.__dict__.items()
                       if k not in state and k not in RUNTIME_ATTRIBUTES and not (is_graph and k in SPEC_ATTRIBUTES)
                       and k not in _copied(module)}
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


def _torch_says(err: Exception) -> str:
    """What a ``torch.load`` error met, past its advice on weights_only: its type (a bare "101" is
    a KeyError) and the first sentence of the line that says it."""
    text = str(err).split("WeightsUnpickler error:")[-1]
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    found = next((line for line in lines if "Unsupported" in line), lines[0] if lines else "")
    sentence = found.split(". ")[0].rstrip(".")
    return f"{type(err).__name__}: {sentence}" if sentence else type(err).__name__


def _unreadable(err: Exception) -> str:
    """Why ``torch.load(weights_only=True)`` refused a file, torch's own words last."""
    said = _torch_says(err)
    if "Unsupported global" in said:  # a pickled class or function: what save never writes
        why = "it holds pickled objects (code), which lucid_fx.save never writes and load does not run"
    else:
        why = ("it looks truncated or corrupted (or is not a torch.save file at all): write it again with "
               "lucid_fx.save, or copy it again if it came from elsewhere")
    return f"{why}; torch.load(weights_only=True) refused it: {said}"


def load(path: Union[str, os.PathLike, Any], *, map_location: Any = None, allow: Iterable[Any] = ()) -> nn.Module:
    """Read a model written by :func:`save`: no pickled code runs (``torch.load(weights_only=True)``),
    classes and functions resolve only against the allowlist and ``allow``, and the model is
    checked to be one save could have written and to run on the input shapes it records.

    Args:
        path: a file name or a readable binary file object.
        map_location: as for ``torch.load`` (``"cpu"``, ``"cuda"``, a device, ...).
        allow: the extra classes and functions given to :func:`save`, if any: these are trusted.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not one save writes, naming the module, node or key that is wrong.

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
        raise ValueError(f"lucid_fx.load: {name} is not {expected} written by lucid_fx.save: {_unreadable(err)}") from None
    if not (isinstance(payload, dict) and isinstance(payload.get("format"), str) and payload["format"] == FORMAT):
        raise ValueError(f"lucid_fx.load: {name} was not written by lucid_fx.save (expected {expected})")
    if type(payload.get("version")) is not int or payload["version"] != FORMAT_VERSION:
        raise ValueError(f"lucid_fx.load: {name} has format version {payload.get('version')!r}; this lucid_fx reads version {FORMAT_VERSION}")
    for key, typ in (("torch", str), ("model", dict)):
        if not isinstance(payload.get(key), typ) or set(payload) != {"format", "version", "torch", "model"}:
            raise ValueError(f"lucid_fx.load: {name} is malformed: expected the keys format, version, torch and model")
    model = decode_module(payload["model"], "", Codec(allow), {})
    for path, module in model.named_modules():
        if isinstance(module, fx.GraphModule):
            check_qparams(module, where_is(path))
            check_runs(module, where_is(path))
            attach_guard(module)  # the activation-qparams guard: lucid_fx's own hook, which save does not write
            if ACTIVATION_QPARAMS in module._buffers and runs_int8_kernels(module):  # as convert does (not reference mode)
                install_programs(module)  # programs for this machine, built as it is called
    return model
