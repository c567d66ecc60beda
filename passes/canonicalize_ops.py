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
from lucid_fx.op_overloads import overloaded
from lucid_fx.ops import CanonicalCall
from lucid_fx.registry import Registry

__all__ = ["canonicalize_ops"]


def _raw_name(node: fx.Node) -> str:
    if node.op == "call_module":
        return node.target
    return getattr(node.target, "__name__", str(node.target))


def _unknown_name(node: fx.Node, module, known) -> str:
    """The op name of a call no spelling knows: its own name (a leaf module's path, a function's or
    method's name), qualified where that is a name the rules know, so that no rule takes it for the op
    it is not (a user's leaf module at ``self.linear`` is no ``nn.Linear``; its weight means what its
    forward does with it): ``Scaled:linear``, ``mypkg.ops.softmax``, ``Tensor.softmax``."""
    name = _raw_name(node)
    if name not in known:
        return name
    if module is not None:
        return f"{type(module).__name__}:{name}"
    if node.op == "call_method":
        return f"Tensor.{name}"
    return f"{getattr(node.target, '__module__', None) or '?'}.{name}"


def canonicalize_ops(gm: fx.GraphModule, registry: Registry) -> fx.GraphModule:
    """Annotate every node of ``gm`` with ``node.meta[OP]``; the graph itself is unchanged."""
    known = registry.op_names()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            node.meta[_meta.OP] = CanonicalCall(node.op, {}, False, node.op)
            continue
        module = gm.get_submodule(node.target) if node.op == "call_module" else None
        spelling = registry.spelling_for(node.op, module if module is not None else node.target)
        if spelling is None:
            node.meta[_meta.OP] = CanonicalCall(
                _unknown_name(node, module, known), {"input": node.args[0]} if node.args else {}, False, _raw_name(node),
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
        op, args = overloaded(spelling.op, args)  # torch.max(a, b) is maximum, x.mT a transpose (lucid_fx/op_overloads.py)
        node.meta[_meta.OP] = CanonicalCall(op, args, inplace, spelling.text, node.target if module is not None else None)
    return gm
