"""A graph read from a file: every node's target from a closed list, every argument data, and the
whole graph run on the meta device against the shapes and dtypes the file records.

Per node kind (fx's six):

=============  =============================================  ==================================
kind           target                                         args / kwargs
=============  =============================================  ==================================
placeholder    an identifier (the forward argument's name)    none, or its default value
get_attr       a parameter, buffer or tensor of the module    none
call_module    a submodule (built from allowlisted classes)   data and earlier nodes
call_function  an allowlisted function (or one in ``allow``)  data and earlier nodes
call_method    a public torch.Tensor method, on a node        data and earlier nodes
output         ``"output"``, last and once                    one value that holds a node
=============  =============================================  ==================================
"""

from __future__ import annotations

import keyword
import re
from typing import Any, Dict, List

import torch
from torch import fx, nn
from torch.fx.passes.shape_prop import TensorMetadata

from lucid_fx import _allowlist as A
from lucid_fx import _meta
from lucid_fx._codec import Codec
from lucid_fx._load_values import META_KEYS, check_data, check_meta
from lucid_fx._pytree_spec import decode_codegen

__all__ = ["decode_graph", "check_runs"]

_NODE = {"name": str, "op": str, "target": object, "args": object, "kwargs": object, "tensor_type": bool, "meta": dict}
_OPTIONAL = {"value_type": list}  # a get_attr node's tensor: [shape, dtype name]
_PART = re.compile(r"[A-Za-z0-9_]+")
_KINDS = ("placeholder", "get_attr", "call_function", "call_method", "call_module", "output")


def _walk(gm: nn.Module, target: Any, op: str, where: str) -> Any:
    """A get_attr/call_module target walks only the module tree: submodules, parameters, buffers
    and tensor attributes, never a method, a class or a function's globals."""
    if not (isinstance(target, str) and all(_PART.fullmatch(p) and not p.startswith("__") for p in target.split("."))):
        raise ValueError(f"{where}: malformed {op} target {target!r:.80}")
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
                found = plain if isinstance(plain, torch.Tensor) else None
        if found is None:
            raise ValueError(f"{where}: {op} target {target!r} is not a submodule, parameter, buffer or tensor of the loaded module")
        value = found
    if (op == "call_module") != isinstance(value, nn.Module):
        raise ValueError(f"{where}: {op} target {target!r} is a {type(value).__name__}, not a {'module' if op == 'call_module' else 'tensor'}")
    return value


def _target(record: Dict[str, Any], gm: nn.Module, codec: Codec, where: str, placeholders: set) -> Any:
    op, target = record["op"], record["target"]
    if op == "call_function":
        if not (isinstance(target, dict) and set(target) == {"$", "v"} and target["$"] == "fn"):
            raise ValueError(f"{where}: a call_function target must be a function on the allowlist, got {target!r:.80}")
        return codec.fn(target["v"], where)
    if op == "call_method":
        if not (isinstance(target, str) and target in A.TENSOR_METHODS):
            raise ValueError(f"{where}: method {target!r:.60} is not a public torch.Tensor method on the allowlist")
    elif op in ("get_attr", "call_module"):
        value = _walk(gm, target, op, where)
        if op == "get_attr" and "value_type" in record:
            shape, dtype = record["value_type"] if len(record["value_type"]) == 2 else (None, None)
            if list(value.shape) != shape or str(value.dtype) != dtype:
                raise ValueError(f"{where}: tensor {target!r} is {value.dtype} {list(value.shape)}; the graph was built for {dtype} {shape}")
    elif op == "placeholder":
        bare = target.lstrip("*") if isinstance(target, str) else ""
        if not (bare.isidentifier() and not keyword.iskeyword(bare) and bare != "self" and target.count("*") <= 2
                and bare not in placeholders):
            raise ValueError(f"{where}: malformed placeholder name {target!r:.60}")
        placeholders.add(bare)
    elif op == "output" and target != "output":
        raise ValueError(f"{where}: malformed output node")
    return target


def _has_node(value: Any) -> bool:
    found: List[fx.Node] = []
    fx.node.map_arg(value, found.append)
    return bool(found)


def _check_arguments(op: str, target: Any, args: Any, kwargs: Any, where: str, codec: Codec) -> None:
    if not isinstance(args, tuple) or not isinstance(kwargs, dict):
        raise ValueError(f"{where}: malformed arguments")
    if any(not (isinstance(k, str) and k.isidentifier()) or keyword.iskeyword(k) for k in kwargs):
        raise ValueError(f"{where}: keyword argument names must be identifiers, got {list(kwargs)!r:.80}")
    check_data((args, kwargs), where, codec.allowed)
    arity = {"placeholder": (0, 1), "get_attr": (0, 0), "output": (1, 1)}.get(op)
    if arity and not (arity[0] <= len(args) <= arity[1] and not kwargs):
        raise ValueError(f"{where}: a {op} node takes {arity[1]} argument(s), the file gives {len(args)} and {len(kwargs)} by keyword")
    if op == "placeholder" and _has_node(args):
        raise ValueError(f"{where}: a placeholder's default must be data, not a node")
    if op == "output" and not _has_node(args):
        raise ValueError(f"{where}: the graph must return values it computes, not only constants")
    if op == "call_method" and not (args and isinstance(args[0], fx.Node)):
        raise ValueError(f"{where}: method {target!r} must be called on a graph value")
    if target is getattr and not (len(args) == 2 and isinstance(args[0], fx.Node) and args[1] in A.TENSOR_ATTRIBUTES):
        raise ValueError(f"{where}: getattr is allowed only for tensor attributes (shape, dtype, ...), got {args[1:]!r:.60}")
    if op == "call_function" and kwargs and target in A.BUILTINS.values() and target is not getattr:
        raise ValueError(f"{where}: {target.__name__}() takes no keyword arguments from a file")


def decode_graph(data: Dict[str, Any], gm: fx.GraphModule, codec: Codec, path: str) -> fx.Graph:
    owner = f"module {path!r}" if path else "the root module"
    if not (isinstance(data, dict) and set(data) in ({"nodes"}, {"nodes", "pytree"}) and isinstance(data["nodes"], list) and data["nodes"]):
        raise ValueError(f"{owner}: malformed graph record")
    graph, nodes, placeholders = fx.Graph(), {}, set()
    records: List[Dict[str, Any]] = data["nodes"]
    for i, record in enumerate(records):
        name = record.get("name") if isinstance(record, dict) else None
        op = record.get("op") if isinstance(record, dict) else None
        where = f"node {name!r:.60} ({op!s:.20}) in {owner}" if isinstance(name, str) else f"node #{i} in {owner}"
        if not (isinstance(record, dict) and set(_NODE) <= set(record) and all(isinstance(record[k], t) for k, t in _NODE.items())
                and set(record) <= set(_NODE) | set(_OPTIONAL) and all(isinstance(record.get(k, []), t) for k, t in _OPTIONAL.items())):
            raise ValueError(f"{where}: malformed node record (keys {sorted(map(str, record)) if isinstance(record, dict) else '-'})")
        op = record["op"]
        if op not in _KINDS or not name.isidentifier() or name in nodes:
            raise ValueError(f"{where}: {'duplicate node name' if name in nodes else 'unknown node kind or malformed name'}")
        if (op == "output") != (i == len(records) - 1) or (op == "placeholder" and any(n.op != "placeholder" for n in nodes.values())):
            raise ValueError(f"{where}: placeholders must come first, the output node last and only once")
        target = _target(record, gm, codec, where, placeholders)
        args, kwargs = codec.decode(record["args"], where, nodes), codec.decode(record["kwargs"], where, nodes)
        _check_arguments(op, target, args, kwargs, where, codec)
        nodes[name] = graph.create_node(op, target, args, kwargs, name=name, type_expr=torch.Tensor if record["tensor_type"] else None)
    earlier: Dict[str, fx.Node] = {}
    for record, node in zip(records, graph.nodes):  # meta names nodes before its own (a call's inputs)
        for key, value in record["meta"].items():
            where = f"node {record['name']!r}, meta {key!r:.60} in {owner}"
            if key not in META_KEYS:
                raise ValueError(f"{where}: not a key lucid_fx writes")
            node.meta[key] = codec.decode(value, where, earlier)
            check_meta(key, node.meta[key], where, codec.allowed)
        earlier[record["name"]] = node
    try:
        graph.lint()
    except RuntimeError as err:
        raise ValueError(f"{owner}: malformed graph: {err}") from None
    if "pytree" in data:  # a torch.export graph's call structure
        decode_codegen(graph, data["pytree"], owner)
    return graph


def _expected(node: fx.Node) -> Any:
    """(shape, dtype) the file records for a node's output, or None."""
    known = node.meta.get(_meta.VALUE_TYPE)  # converted nodes: what the int8 kernel returns
    if known is not None:
        return list(known[0]), known[1]
    meta = node.meta.get(_meta.TENSOR_META)
    return (list(meta.shape), meta.dtype) if isinstance(meta, TensorMetadata) else None


class _Unknowable(Exception):
    """The graph needs values, not just shapes, past this node."""


class _Checker(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, owner: str) -> None:
        super().__init__(gm)
        self.owner = owner
        self.extra_traceback = False  # the message names the node already

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        if "device" in kwargs:  # a factory the graph pins to a device (Llama's causal mask: full(..., device=cpu))
            kwargs = {**kwargs, "device": torch.device("meta")}
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        where = f"node {n.name!r} ({n.op}) in {self.owner}"
        try:
            out = super().run_node(n)
        except Exception as err:  # noqa: BLE001 - whatever it is, the graph does not run
            first = str(err).strip().splitlines()[0] if str(err).strip() else ""
            if isinstance(err, NotImplementedError) or "meta tensor" in first or "expected device" in first:
                raise _Unknowable from None  # data-dependent (nonzero, .item()) or pinned to a device: not knowable here
            raise ValueError(f"{where}: the graph does not run on the input shapes the file records "
                             f"({type(err).__name__}: {first:.200})") from None
        expected = _expected(n)
        got = (list(out.shape), out.dtype) if isinstance(out, torch.Tensor) else None
        if expected is not None and got != expected:
            what = f"{got[1]} {got[0]}" if got else f"a {type(out).__name__}"
            raise ValueError(f"{where}: computes {what}, but the file records {expected[1]} {expected[0]}")
        return out


def _quant_identities(gm: nn.Module) -> List[tuple]:
    """(parent, name, module) of every observer and fake quant: identities in shape and dtype,
    whose statistics are data-dependent (they cannot run on fake tensors)."""
    from lucid_fx.quantization.fake_quantize import FakeQuantize
    from lucid_fx.quantization.observers import ObserverBase

    return [(parent, name, child) for parent in gm.modules() for name, child in parent._modules.items()
            if isinstance(child, (ObserverBase, FakeQuantize))]


def _on_meta(gm: nn.Module) -> List[tuple]:
    """Swap every tensor of ``gm`` (parameters, buffers, tensor constants) for an empty one of its
    shape and dtype on the meta device; returns what to put back."""
    swaps = []
    for module in gm.modules():
        tables = [module._parameters, module._buffers, module.__dict__]
        for table in tables:
            for name, value in list(table.items()):
                if isinstance(value, torch.Tensor):
                    meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
                    swaps.append((table, name, value))
                    table[name] = nn.Parameter(meta, value.requires_grad) if isinstance(value, nn.Parameter) else meta
    return swaps


def check_runs(gm: fx.GraphModule, owner: str) -> None:
    """Run ``gm`` on the meta device (shapes and dtypes only: nothing is computed) from its
    placeholders' recorded ``tensor_meta``: every node must run, and produce the shape and dtype
    the file records for it. Observers and fake quants (identities in shape and dtype, with
    data-dependent statistics) are swapped for nn.Identity while it runs; everything is put back."""
    inputs = []  # (placeholder, its recorded tensor_meta)
    fixed = getattr(gm.graph._codegen, "fixed_inputs", dict)()  # a torch.export capture's non-tensor inputs
    for node in gm.graph.nodes:
        meta = node.meta.get(_meta.TENSOR_META)
        if node.op != "placeholder":
            continue
        if node.name in fixed:
            inputs.append((node, fixed[node.name]))
            continue
        if node.target.startswith("*"):
            return  # forward(*args): which input is which is not recorded
        if not isinstance(meta, TensorMetadata) and node.args:
            break  # an input with a default (a number, None): the inputs before it are enough
        inputs.append((node, meta))
    known = [n.name for n, m in inputs if isinstance(m, TensorMetadata)]
    if not known:
        return  # a graph saved without shapes (not made by prepare): nothing to check against
    missing = [n.name for n, m in inputs if not isinstance(m, TensorMetadata) and n.name not in fixed]
    if missing:
        raise ValueError(f"node {missing[0]!r} (placeholder) in {owner}: the file records no shape for this input, "
                         f"but does for {known[0]!r}")
    metas = [m for _, m in inputs]
    swaps = [(parent._modules, name, child) for parent, name, child in _quant_identities(gm)]
    try:
        for table, name, _ in swaps:
            table[name] = nn.Identity()
        swaps += _on_meta(gm)
        with torch.no_grad(), torch.device("meta"):  # a tensor the graph makes is a meta one too
            _Checker(gm, owner).run(*[torch.empty(m.shape, dtype=m.dtype) if isinstance(m, TensorMetadata) else m for m in metas])
    except _Unknowable:
        pass  # checked up to the first node whose output shape depends on values
    finally:
        for table, name, value in reversed(swaps):
            table[name] = value
