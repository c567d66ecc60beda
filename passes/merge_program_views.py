"""merge_program_views: a program takes each view of a value once, and a value viewed as itself is the value.

The portable graph keeps ``x.view_as(x)`` where a value keeps its codes on a new grid (a rescale by a
constant: rules/lowering_elementwise.py) and where a value is read after an op written in place
(passes/functionalize_inplace.py); torch.export writes GPT-2's ``split(qkv, 64, 2)`` once for each part
read (three identical splits a layer) and Mixtral's ``chunk`` twice. Each is a call on every run of the
program. A view shares its input's storage and describes it the same way on every call with the same
arguments, so two such calls are one and ``view_as(x, x)`` is ``x``: reading either sees the same values,
before and after any write in place. Only views are merged (a ``reshape`` may copy; two copies are two
values), and ``getitem`` only of a view's tuple.
"""

from __future__ import annotations

import operator
from typing import Any, Dict

import torch
from torch import fx

__all__ = ["merge_program_views", "VIEW_FUNCTIONS", "VIEW_METHODS"]

#: Functions and methods that return views of their first argument (a tuple of views for the splits).
VIEW_FUNCTIONS = frozenset({torch.split, torch.split_with_sizes, torch.tensor_split, torch.chunk, torch.unbind,
                            torch.permute, torch.transpose, torch.unsqueeze, torch.squeeze, torch.narrow, torch.select,
                            torch.t})
VIEW_METHODS = frozenset({"view", "view_as", "expand", "expand_as", "split", "tensor_split", "chunk", "unbind",
                          "permute", "transpose", "unsqueeze", "squeeze", "narrow", "select", "t"})
_TUPLES = frozenset({torch.split, torch.split_with_sizes, torch.tensor_split, torch.chunk, torch.unbind, "split",
                     "tensor_split", "chunk", "unbind"})


def _is_view(node: fx.Node) -> bool:
    if node.op == "call_function" and node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, fx.Node) and source.target in _TUPLES and _is_view(source)
    return (node.op == "call_function" and node.target in VIEW_FUNCTIONS) or (
        node.op == "call_method" and node.target in VIEW_METHODS)


def _key(value: Any) -> Any:
    """A hashable form of a call's arguments (lists as tuples, nodes as themselves)."""
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_key(v) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((k, _key(v)) for k, v in value.items()))
    if isinstance(value, (fx.Node, int, float, bool, str, type(None), torch.dtype)):
        return value
    raise TypeError  # anything else (a tensor constant): not merged


def merge_program_views(program: fx.GraphModule) -> int:
    """Merge the views of ``program`` in place (see the module); the number of calls removed."""
    seen: Dict[Any, fx.Node] = {}
    removed = 0
    for node in list(program.graph.nodes):
        if not _is_view(node):
            continue
        if node.op == "call_method" and node.target == "view_as" and len(node.args) == 2 and node.args[0] is node.args[1]:
            same = node.args[0]
        else:
            try:
                key = (node.op, node.target, _key(node.args), _key(node.kwargs))
            except TypeError:
                continue
            same = seen.setdefault(key, node)
            if same is node:
                continue
        node.replace_all_uses_with(same)
        program.graph.erase_node(node)
        removed += 1
    return removed
