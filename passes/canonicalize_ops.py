"""canonicalize_ops: give every node its canonical op, once.

Writes ``node.meta[OP]``, a :class:`lucid_fx.ops.CanonicalCall`: the canonical name (module,
``torch.*``, ``F.*``, method, in-place and ``operator.*`` spellings of sigmoid are all
``"sigmoid"``), the arguments by canonical name with implied constants filled in (``F.relu6``
becomes ``clamp(min=0, max=6)``), and whether the spelling was in place. Later passes match
canonical names only.
"""

from __future__ import annotations

from torch import fx

from lucid_fx import _meta
from lucid_fx.ops import CanonicalCall
from lucid_fx.registry import Registry

__all__ = ["canonicalize_ops"]


def _raw_name(node: fx.Node) -> str:
    if node.op == "call_module":
        return node.target
    return getattr(node.target, "__name__", str(node.target))


def canonicalize_ops(gm: fx.GraphModule, registry: Registry) -> fx.GraphModule:
    """Annotate every node of ``gm`` with ``node.meta[OP]``; the graph itself is unchanged."""
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            node.meta[_meta.OP] = CanonicalCall(node.op, {}, False, node.op)
            continue
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        spelling = registry.spelling_for(node.op, module if module is not None else node.target)
        if spelling is None:
            node.meta[_meta.OP] = CanonicalCall(
                _raw_name(node), {"input": node.args[0]} if node.args else {}, False, _raw_name(node),
                node.target if module is not None else None,
            )
            continue
        args = {}
        positional = list(node.args)
        params = spelling.params
        if module is None and len(positional) > len(params):
            # varargs spellings: x.view(2, -1), x.permute(0, 2, 1)
            positional = positional[: len(params) - 1] + [tuple(positional[len(params) - 1 :])]
        for name, value in zip(params, positional):
            args[name] = value
        for key, value in node.kwargs.items():
            args[spelling.renames.get(key, key)] = value
        consts = spelling.consts(module) if callable(spelling.consts) else (spelling.consts or {})
        for key, value in consts.items():
            args.setdefault(key, value)
        inplace = spelling.inplace or args.get("inplace") is True or bool(getattr(module, "inplace", False))
        node.meta[_meta.OP] = CanonicalCall(
            spelling.op, args, inplace, spelling.text, node.target if module is not None else None
        )
    return gm
