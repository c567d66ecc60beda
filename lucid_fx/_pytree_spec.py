"""The call structure of a torch.export graph (its ``_PyTreeCodeGen``: how ``forward``'s positional
and keyword arguments flatten into placeholders, and how the outputs fold back into the model's
dict or tuple), written by save as two JSON strings and read back by load; for a ``forward`` with
the model's own signature or torch.export's call with input checks (lucid_fx/_forward_signature.py),
also its parameters, input shapes and fixed values as data: names that must be identifiers,
literal defaults and values, and lists of sizes, checked before they become code. Pickling
writes the same record (:func:`export_call`, :func:`restore_signature`).

``torch.utils._pytree.treespec_loads`` parses JSON and resolves each node type only against
pytree's own registry of serializable types (tuple, list, dict, namedtuples and classes someone
registered in this process), never by importing a name from the file, so it stays inside the
save format's threat model (docs/policies.md). Load also checks that the input spec has one leaf
per placeholder and the output spec one per output value.
"""

from __future__ import annotations

import contextlib
import keyword
from typing import Any, Dict, Iterator, List, Optional

import torch.utils._pytree as pytree
from torch import fx

from lucid_fx._allowlist import NotSerializable
from lucid_fx._forward_signature import KINDS, RESERVED, SignatureCodeGen, captured_names, literal

__all__ = ["SPEC_ATTRIBUTES", "has_pytree_codegen", "encode_codegen", "decode_codegen", "export_call", "restore_signature"]

#: What GraphModule sets from a pytree codegen (load sets them again from the graph it builds).
SPEC_ATTRIBUTES = frozenset({"_in_spec", "_out_spec"})


def has_pytree_codegen(gm: Any) -> bool:
    return isinstance(gm, fx.GraphModule) and isinstance(gm.graph._codegen, fx.graph._PyTreeCodeGen)


def encode_codegen(gm: fx.GraphModule, where: str) -> Optional[List[Any]]:
    """None for a plain graph; [in spec, out spec] as JSON for an exported one, and its forward's
    parameters where it has the model's signature."""
    codegen = gm.graph._codegen
    if type(codegen) is fx.graph.CodeGen:
        return None
    if not isinstance(codegen, fx.graph._PyTreeCodeGen):
        raise NotSerializable(f"{where}: its graph has a {type(codegen).__name__}, which lucid_fx.save cannot write")
    info = codegen.pytree_info
    signature = [record_of(codegen)] if isinstance(codegen, SignatureCodeGen) else []
    try:
        return [pytree.treespec_dumps(info.in_spec), pytree.treespec_dumps(info.out_spec)] + signature
    except Exception as err:  # noqa: BLE001 - a type pytree cannot serialize: say which
        raise NotSerializable(
            f"{where}: the exported call structure (inputs {info.in_spec}, outputs {info.out_spec}) cannot be "
            f"written as data ({type(err).__name__}: {err}); register the output class with "
            "torch.utils._pytree.register_pytree_node(..., serialized_type_name=...) or return a dict or tuple"
        ) from None


def decode_codegen(graph: fx.Graph, specs: Any, owner: str) -> None:
    """Give ``graph`` the pytree codegen ``specs`` (from :func:`encode_codegen`) describes."""
    if not (isinstance(specs, list) and len(specs) in (2, 3) and all(isinstance(s, str) for s in specs[:2])):
        raise ValueError(f"{owner}: malformed pytree record")
    try:
        in_spec, out_spec = (pytree.treespec_loads(s) for s in specs[:2])
    except Exception as err:  # noqa: BLE001 - any parse or lookup failure is a bad file
        raise ValueError(f"{owner}: unreadable pytree spec ({type(err).__name__}: {str(err)[:200]})") from None
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    outputs = output.args[0]
    if in_spec.num_leaves != len(placeholders) or not isinstance(outputs, (tuple, list)) or out_spec.num_leaves != len(outputs):
        raise ValueError(f"{owner}: the pytree spec does not fit the graph ({in_spec.num_leaves} inputs for "
                         f"{len(placeholders)} placeholders, {out_spec.num_leaves} outputs)")
    info = fx.graph._PyTreeInfo(placeholders, in_spec, out_spec)
    graph.set_codegen(codegen_of(info, specs[2], f"{owner}: forward") if len(specs) == 3 else fx.graph._PyTreeCodeGen(info))


def record_of(codegen: SignatureCodeGen) -> Dict[str, Any]:
    """What :func:`codegen_of` builds ``codegen`` again from (plain data)."""
    record = {"params": None if codegen.params is None else [dict(p) for p in codegen.params], "shapes": codegen.shapes}
    if codegen.params is None:
        record["fixed"] = codegen.fixed_inputs()
    return record


def codegen_of(info: Any, record: Any, where: str) -> SignatureCodeGen:
    """The codegen a record from :func:`record_of` describes, each part checked (a ValueError
    naming ``where``): a file's record is held to this before any of it becomes code. Records
    written before torch.export's call had checks are ``{"params", "shapes"}``."""
    keys = {"params", "shapes"} | ({"fixed"} if isinstance(record, dict) and record.get("params") is None else set())
    if not (isinstance(record, dict) and set(record) == keys):
        raise ValueError(f"{where}: malformed forward signature record")
    params = None if record["params"] is None else check_params(record["params"], info.in_spec, where)
    return SignatureCodeGen(info, params, check_shapes(record["shapes"], len(info.orig_args), where),
                            check_fixed(record.get("fixed", {}), info.orig_args, where))


def check_params(params: Any, in_spec: Any, where: str) -> List[Dict[str, Any]]:
    """``params`` as a valid parameter list for ``in_spec``, or a ValueError naming ``where``:
    load holds a file's record to this before any of it becomes code."""
    if not isinstance(params, list) or not params:
        raise ValueError(f"{where}: the forward signature is not a list of parameters")
    seen, keyword_only, defaulted = set(), False, False
    for p in params:
        if not (isinstance(p, dict) and set(p) <= {"name", "kind", "default", "fixed", "captured"}
                and {"name", "kind", "captured"} <= set(p)):
            raise ValueError(f"{where}: malformed forward parameter {p!r:.80}")
        name = p["name"]
        if not (isinstance(name, str) and name.isidentifier() and not keyword.iskeyword(name) and name not in RESERVED):
            raise ValueError(f"{where}: forward parameter name {name!r:.60} is not a Python identifier the code can take")
        if name in seen or p["kind"] not in KINDS or type(p["captured"]) is not bool:
            raise ValueError(f"{where}: forward parameter {name!r} is repeated or malformed")
        for key in ("default", "fixed"):
            if key in p and not literal(p[key]):
                raise ValueError(f"{where}: forward parameter {name!r} has a {key} that is not a literal")
        if p["kind"] == "positional" and keyword_only:
            raise ValueError(f"{where}: positional parameter {name!r} after a keyword-only one")
        if not p["captured"] and ("default" not in p or "fixed" in p):
            raise ValueError(f"{where}: forward parameter {name!r} was not captured and has no default")
        if p["kind"] == "positional" and "default" not in p and defaulted:
            raise ValueError(f"{where}: positional parameter {name!r} without a default follows one with a default")
        keyword_only = keyword_only or p["kind"] == "keyword"
        defaulted = defaulted or (p["kind"] == "positional" and "default" in p)
        seen.add(name)
    if captured_names(in_spec) != [p["name"] for p in params if p["captured"]]:
        raise ValueError(f"{where}: the forward signature does not fit the graph's inputs")
    return params


def check_shapes(shapes: Any, placeholders: int, where: str) -> List[Optional[List[int]]]:
    """``shapes`` as one shape (a list of sizes, None for a dynamic dim) or None per placeholder, or a
    ValueError naming ``where``."""
    if not (isinstance(shapes, list) and len(shapes) == placeholders and all(
            s is None or (isinstance(s, list) and all(d is None or (type(d) is int and d >= 0) for d in s)) for s in shapes)):
        raise ValueError(f"{where}: the input shapes are not one list of sizes (or None) per input")
    return shapes


def check_fixed(fixed: Any, placeholders: List[str], where: str) -> Dict[str, Any]:
    """``fixed`` as a dict of placeholder name to literal value, or a ValueError naming ``where``."""
    if not (isinstance(fixed, dict) and all(k in placeholders and literal(v) for k, v in fixed.items())):
        raise ValueError(f"{where}: the fixed input values are not literals of the graph's inputs")
    return fixed


class RetraceTracer(fx.Tracer):
    """The tracer unpickling rebuilds an exported graph with: buffers are proxies, as the graph's
    get_attr nodes are, so ``bias[:, :, :n]`` of a dynamic ``n`` traces (fx's default tracer reads
    a buffer as a tensor, which a slice of a proxy cannot index)."""

    proxy_buffer_attributes = True


@contextlib.contextmanager
def export_call(gm: fx.GraphModule) -> Iterator[Optional[Dict[str, Any]]]:
    """For pickling, which rebuilds a GraphModule by tracing its forward: ``gm`` with torch.export's own
    call while inside (the input checks would stop that trace) and :class:`RetraceTracer` to trace it,
    yielding the parameters and input shapes to :func:`restore_signature` from (None, and no change,
    for any other forward)."""
    codegen = gm.graph._codegen
    if not isinstance(codegen, SignatureCodeGen):
        yield None
        return
    gm.graph.set_codegen(fx.graph._PyTreeCodeGen(codegen.pytree_info))
    gm.recompile()
    tracer = gm.__dict__.get("_tracer_cls")
    gm._tracer_cls = RetraceTracer
    try:
        yield record_of(codegen)
    finally:
        gm._tracer_cls = tracer
        gm.graph.set_codegen(codegen)
        gm.recompile()


def restore_signature(gm: fx.GraphModule, record: Dict[str, Any]) -> None:
    """``gm`` unpickled (torch.export's call, traced: its outputs folded back into their structure)
    given the forward with the model's signature again, its flat outputs and input spec as before."""
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    flat, spec = pytree.tree_flatten(output.args[0])  # fx's immutable dicts and lists: dicts and lists, in order
    if spec.num_leaves != gm._out_spec.num_leaves:
        raise ValueError(f"unpickling: the model's outputs {spec} are not the saved ones {gm._out_spec}")
    output.args = (flat,)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    info = fx.graph._PyTreeInfo(placeholders, gm._in_spec, gm._out_spec)
    gm.graph.set_codegen(codegen_of(info, record, "unpickling: forward"))
    gm.recompile()
