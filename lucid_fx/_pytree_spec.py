"""The call structure of a torch.export graph (its ``_PyTreeCodeGen``: how ``forward``'s positional
and keyword arguments flatten into placeholders, and how the outputs fold back into the model's
dict or tuple), written by save as two JSON strings and read back by load; for a ``forward`` with
the model's own signature (lucid_fx/_forward_signature.py), also its parameters and input shapes
as data: names that must be identifiers, literal defaults and values, and lists of sizes, checked
before they become code.

``torch.utils._pytree.treespec_loads`` parses JSON and resolves each node type only against
pytree's own registry of serializable types (tuple, list, dict, namedtuples and classes someone
registered in this process), never by importing a name from the file, so it stays inside the
save format's threat model (docs/policies.md). Load also checks that the input spec has one leaf
per placeholder and the output spec one per output value.
"""

from __future__ import annotations

from typing import Any, List, Optional

import torch.utils._pytree as pytree
from torch import fx

from lucid_fx._codec import NotSerializable
from lucid_fx._forward_signature import SignatureCodeGen, check_params, check_shapes

__all__ = ["SPEC_ATTRIBUTES", "has_pytree_codegen", "encode_codegen", "decode_codegen"]

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
    signature = ([{"params": [dict(p) for p in codegen.params], "shapes": codegen.shapes}]
                 if isinstance(codegen, SignatureCodeGen) else [])
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
    if len(specs) == 3:
        record = specs[2]
        if not (isinstance(record, dict) and set(record) == {"params", "shapes"}):
            raise ValueError(f"{owner}: malformed forward signature record")
        graph.set_codegen(SignatureCodeGen(info, check_params(record["params"], in_spec, f"{owner}: forward"),
                                           check_shapes(record["shapes"], len(placeholders), f"{owner}: forward")))
    else:
        graph.set_codegen(fx.graph._PyTreeCodeGen(info))
