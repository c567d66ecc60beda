"""fold_signature_constants: values a program would compute the same way on every call become constants.

A program is built for one input signature (:mod:`lucid_fx.program`): the inputs' shapes, dtypes and
strides are fixed, so everything computed only from the model's constants and the inputs' shapes is
the same on every call. Transformers models compute a lot of it per call: Llama's rotary cos/sin
tables from ``arange(seq_len)`` (a quantize, a matmul, a cat and two lookups per call), ViT's class
token expanded to the batch. This pass computes such values once, with the same kernels, and the
program reads them as constants: the same values, none of the calls.

What counts as constant: ``get_attr`` (the converted model's tensors), reads of an input's
``shape``/``size()``/``dim()``/``dtype`` (fixed by the signature; the recorded values say what
they are), and a pure call whose inputs are all constant. Never folded:

- ``call_module`` (a child may keep state), impure calls (``Node.is_impure``: asserts, random ops)
  and anything named like a random or uninitialised op;
- every value an in-place op writes (``x.copy_(...)``, ``x[i] = v``, ``inplace=True``, a mutable
  schema), and everything it was computed from: a folded tensor is shared by every call;
- a returned value, and what it is a view of: the caller may write into what it gets back.

Weights edited in place after convert reach a program only through ``recompile`` (documented in
:mod:`lucid_fx.program`); folded values follow the same rule.
"""

from __future__ import annotations

import builtins
from typing import Any, Dict, Optional, Set

import torch
from torch import fx

from lucid_fx.node_refs import call_name, unstable_name, writes_in_place
from lucid_fx.aliasing import VIEW_SPELLINGS
from lucid_fx.ops import OP_DEFS, Tag

__all__ = ["fold_signature_constants", "kept_by_dead_code_elimination", "GUARDS", "pinned", "foldable_call", "evaluate",
           "SHAPE_ATTRIBUTES", "SHAPE_METHODS"]

#: Attributes and methods of an input tensor the signature fixes.
SHAPE_ATTRIBUTES = frozenset({"shape", "dtype", "ndim"})
SHAPE_METHODS = frozenset({"size", "dim", "numel", "stride"})
# Calls whose result may share the memory of their first argument: the op table's views (their
# aliases included: ``view`` is reshape's) and the view spellings functionalize_inplace reads.
_ALIASING = VIEW_SPELLINGS | {name for op in OP_DEFS if Tag.VIEW in op.tags for name in (op.name, *op.aliases)}


def _ancestors(nodes, through_all: bool) -> Set[fx.Node]:
    """``nodes`` and what they were computed from: through every input, or only through views."""
    seen: Set[fx.Node] = set()
    stack = [n for n in nodes if isinstance(n, fx.Node)]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if through_all:
            stack.extend(node.all_input_nodes)
        elif call_name(node) in _ALIASING and node.args and isinstance(node.args[0], fx.Node):
            stack.append(node.args[0])
    return seen


def pinned(graph: fx.Graph) -> Set[fx.Node]:
    """Values folding must leave to run time: written in place (and their sources), or returned (and their views' bases)."""
    written = [n.args[0] for n in graph.nodes if writes_in_place(n) and n.args]
    outputs = []
    for n in graph.nodes:
        if n.op == "output":
            fx.node.map_arg(n.args, outputs.append)
    return _ancestors(written, through_all=True) | _ancestors(outputs, through_all=False) | set(written)


def _shape_read(node: fx.Node, values: Dict[str, Any]) -> bool:
    source = node.args[0] if node.args else None
    if not (isinstance(source, fx.Node) and isinstance(values.get(source.name), torch.Tensor)):
        return False
    if node.op == "call_function" and node.target is builtins.getattr:
        return node.args[1] in SHAPE_ATTRIBUTES
    return node.op == "call_method" and node.target in SHAPE_METHODS


def foldable_call(node: fx.Node, known: Dict[fx.Node, Any], kept: Set[fx.Node], values: Optional[Dict[str, Any]] = None) -> bool:
    """Whether ``node`` is a pure call of ``known`` inputs only, and not among the ``kept`` (:func:`pinned`)
    values; with the recorded ``values``, a kept number or shape may fold (nothing can write it)."""
    if node.op not in ("call_function", "call_method") or node.is_impure() or writes_in_place(node):
        return False  # an in-place write runs on every call, whatever it writes into
    if node in kept and (values is None or isinstance(values.get(node.name), torch.Tensor)):
        return False
    if unstable_name(call_name(node)):
        return False
    return all(n in known for n in node.all_input_nodes)


def evaluate(node: fx.Node, known: Dict[fx.Node, Any]) -> Any:
    """``node``'s call on the ``known`` values of its inputs."""
    args = fx.node.map_arg(node.args, known.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, known.__getitem__)
    if node.op == "call_method":
        self_arg, *rest = args
        return getattr(self_arg, node.target)(*rest, **kwargs)
    return node.target(*args, **kwargs)


def fold_signature_constants(gm: fx.GraphModule, values: Dict[str, Any]) -> int:
    """Fold, in place, what ``gm`` computes the same on every call with the signature ``values``
    were recorded on (node name -> meta tensor, :func:`~lucid_fx.passes.lower_to_program.record_values`).
    Folded tensors become plain attributes (never state) read by ``get_attr``; folded numbers and
    shapes go into their users' arguments. Returns how many nodes were folded."""
    graph, kept = gm.graph, pinned(gm.graph)
    known: Dict[fx.Node, Any] = {}
    for node in graph.nodes:
        if node.op == "get_attr":
            value = gm
            for part in node.target.split("."):
                value = getattr(value, part)
            known[node] = value
        elif node.op == "call_function" and node.target is builtins.getattr and _shape_read(node, values):
            known[node] = getattr(values[node.args[0].name], node.args[1])
        elif node.op == "call_method" and _shape_read(node, values):
            meta = values[node.args[0].name]
            known[node] = getattr(meta, node.target)(*node.args[1:], **node.kwargs)
        elif foldable_call(node, known, kept, values):
            with torch.no_grad():
                known[node] = evaluate(node, known)
    folded = 0
    for node in list(graph.nodes):
        if node not in known or node.op == "get_attr" or not node.users:
            continue
        value = known[node]
        if isinstance(value, torch.Tensor):
            if value.device.type == "meta":
                continue  # a shape-only value: the data is not known here
            name = f"_folded_{node.name}"
            gm.__dict__[name] = value  # a plain attribute, not a buffer: never state
            with graph.inserting_before(node):
                new = graph.create_node("get_attr", name)
            new.meta = dict(node.meta)
            node.replace_all_uses_with(new)
        elif _inlinable(value):
            for user in list(node.users):
                user.args = fx.node.map_aggregate(user.args, lambda a: value if a is node else a)
                user.kwargs = fx.node.map_aggregate(user.kwargs, lambda a: value if a is node else a)
        else:
            continue
        folded += 1
    graph.eliminate_dead_code(is_impure_node=kept_by_dead_code_elimination)
    return folded


#: The checks torch.fx writes into a graph that nothing reads: a concrete argument's (``concrete_args={"bias":
#: None}``: a call given a bias raises instead of silently ignoring it).
GUARDS = (torch.fx._symbolic_trace._assert_is_none,)


def kept_by_dead_code_elimination(node: fx.Node) -> bool:
    """What dead-code elimination must keep, read or not: impure calls, calls that write in place
    (fx's own test keeps neither ``x.copy_(y)`` nor ``x[i] = v`` when nothing reads the result), children,
    and torch.fx's guards (:data:`GUARDS`)."""
    return node.is_impure() or writes_in_place(node) or node.op == "call_module" or node.target in GUARDS


def _inlinable(value: Any) -> bool:
    """Whether ``value`` can stand in an fx argument (numbers, shapes, dtypes, devices, tuples of them)."""
    if isinstance(value, (int, float, bool, str, torch.dtype, torch.device, type(None))):
        return True
    return isinstance(value, (tuple, list, torch.Size)) and all(_inlinable(v) for v in value)
