"""functionalize_inplace: in-place ops become out-of-place ones where nothing else sees the change.

An in-place op (``h.clamp_(0, 1)``, ``torch.relu_(h)``, ``h += 1``, ``F.relu(h, inplace=True)``,
``nn.ReLU(inplace=True)``) returns the tensor it was given, and code after it often reads the new
value through the old name (``h.sigmoid_(); return self.fc(h)``). Later passes follow data flow,
so that read would see the value *before* the op: observers in the wrong place, and convert
dropping the op. This pass runs right after tracing:

1. every node after the op that reads the changed value reads the op's result instead (the same
   tensor in float, so this alone changes no number);
2. if nothing else can see the change (the value is not a model input, parameter or buffer, and no
   other view of its storage is read after the op), the op becomes its out-of-place form
   (``h.clamp(0, 1)``) and is quantized exactly as that spelling is;
3. otherwise the op stays as written and runs in float, as do the views that share its storage;
   each other view read after the op is read through a ``view_as`` written after it (so its
   observer sees the new value), and ``node.meta[MUTATION]`` says why, for explain and convert.

Reads nothing from ``node.meta``; writes ``node.meta[MUTATION]``. Changes the graph (and sets
``inplace=False`` on in-place modules whose every call was made out of place).
"""

from __future__ import annotations

from typing import Dict, List, Optional, Set

import torch
import torch.nn.functional as F
from torch import fx

from lucid_fx import _meta
from lucid_fx.aliasing import METADATA_ATTRS, OUT_OF_PLACE_OPERATORS, VIEW_OPS, VIEW_SPELLINGS
from lucid_fx.registry import Registry

__all__ = ["functionalize_inplace"]

# ``x.name_()`` whose ``x.name()`` means something else (or nothing).
_NOT_OUT_OF_PLACE = frozenset({"resize_", "set_", "share_memory_", "bernoulli_", "requires_grad_", "retain_grad_"})
_SHAPE_READS = frozenset({"size", "dim", "numel", "nelement", "is_contiguous", "stride", "storage_offset"})


def _spelling(gm: fx.GraphModule, node: fx.Node, registry: Registry):
    target = gm.get_submodule(node.target) if node.op == "call_module" else node.target
    return registry.spelling_for(node.op, target)


def _inplace_flag(node: fx.Node, spelling) -> Optional[tuple]:
    """Where ``inplace=True`` is passed: ("kwarg", "inplace") or ("arg", index); None if not."""
    if node.kwargs.get("inplace") is True:
        return ("kwarg", "inplace")
    params = spelling.params if spelling is not None and node.op != "call_module" else ()
    if "inplace" in params:
        index = params.index("inplace")
        if index < len(node.args) and node.args[index] is True:
            return ("arg", index)
    return None


def _is_torch(fn) -> bool:
    name = getattr(fn, "__name__", "")
    return any(getattr(namespace, name, None) is fn for namespace in (torch, F, torch.special))


def _written(gm: fx.GraphModule, node: fx.Node, registry: Registry) -> Optional[fx.Node]:
    """The value ``node`` writes into, if it is an in-place op on a graph value."""
    first = node.args[0] if node.args else None
    if isinstance(node.kwargs.get("out"), fx.Node):
        return node.kwargs["out"]
    if node.op == "call_method":
        name = node.target
        hit = name.endswith("_") and not name.startswith("_")
    elif node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        hit = node.target in OUT_OF_PLACE_OPERATORS or (_is_torch(node.target) and name.endswith("_") and not name.startswith("_"))
        hit = hit or _inplace_flag(node, _spelling(gm, node, registry)) is not None
    elif node.op == "call_module":
        hit = getattr(gm.get_submodule(node.target), "inplace", False) is True
    else:
        hit = False
    return first if hit and isinstance(first, fx.Node) else None


def _reads_metadata_only(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in _SHAPE_READS
    return node.op == "call_function" and node.target is getattr and len(node.args) > 1 and node.args[1] in METADATA_ATTRS


def _may_alias(gm: fx.GraphModule, node: fx.Node, registry: Registry) -> List[fx.Node]:
    """The inputs whose storage ``node``'s result may share (conservative for unknown ops)."""
    if node.op in ("placeholder", "get_attr", "output") or _reads_metadata_only(node):
        return []
    written = _written(gm, node, registry)
    if written is not None:
        return [written]
    inputs = node.all_input_nodes
    if node.op == "call_function" and node.target is getattr:
        return inputs
    spelling = _spelling(gm, node, registry)
    if spelling is not None:
        return inputs if spelling.op in VIEW_OPS else []
    if node.op == "call_method":
        return inputs if node.target in VIEW_SPELLINGS else []
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        if _is_torch(node.target) or getattr(node.target, "__module__", None) in ("_operator", "operator"):
            return inputs if name in VIEW_SPELLINGS else []
    return inputs  # a user's function or module: it may return its input


def _out_of_place(gm: fx.GraphModule, node: fx.Node, registry: Registry) -> bool:
    """Rewrite ``node`` into its out-of-place form; False when there is none (or it is a module)."""
    if "out" in node.kwargs:
        node.kwargs = {k: v for k, v in node.kwargs.items() if k != "out"}
        return True
    flag = _inplace_flag(node, _spelling(gm, node, registry))
    if flag is not None:
        if flag[0] == "kwarg":
            node.kwargs = {**node.kwargs, "inplace": False}
        else:
            node.args = node.args[: flag[1]] + (False,) + node.args[flag[1] + 1 :]
        return True
    if node.op == "call_method" and node.target not in _NOT_OUT_OF_PLACE:
        if callable(getattr(torch.Tensor, node.target[:-1], None)):
            node.target = node.target[:-1]
            return True
        return False
    if node.op == "call_function":
        if node.target in OUT_OF_PLACE_OPERATORS:
            node.target = OUT_OF_PLACE_OPERATORS[node.target]
            return True
        name = node.target.__name__
        for namespace in (torch, F):
            if getattr(namespace, name, None) is node.target and callable(getattr(namespace, name[:-1], None)):
                node.target = getattr(namespace, name[:-1])
                return True
    return False


def _who_sees(written: fx.Node, roots: Set[fx.Node], live: List[fx.Node]) -> Optional[str]:
    """Why the change to ``written`` cannot be made out of place, or None when nothing sees it."""
    for root in sorted(roots, key=lambda n: n.name):
        if root.op == "placeholder":
            return f"changes model input {root.name!r} in place, which the caller sees"
        if root.op == "get_attr":
            return f"changes {root.target!r} of the module in place, which later calls see"
    if live:
        return f"changes {written.name!r} in place, and {live[0].name!r} shares its storage and is read afterwards"
    return None


class _Storage:
    """Which earlier nodes may share storage, built in one sweep in graph order: a node's storage
    "roots" are its own (a new tensor) or the roots of the inputs it may alias."""

    def __init__(self, nodes: List[fx.Node]) -> None:
        self.order: Dict[fx.Node, float] = {n: float(i) for i, n in enumerate(nodes)}
        self.roots: Dict[fx.Node, Set[fx.Node]] = {}
        self.views: Dict[fx.Node, bool] = {}  # whether the node's result may alias an input
        self._members: Dict[fx.Node, List[fx.Node]] = {}

    def record(self, node: fx.Node, sources: List[fx.Node]) -> None:
        self.roots[node] = set().union(*(self.roots[s] for s in sources)) if sources else {node}
        self.views[node] = bool(sources)
        for root in self.roots[node]:
            self._members.setdefault(root, []).append(node)

    def family(self, node: fx.Node) -> List[fx.Node]:
        """The recorded nodes that may share ``node``'s storage (``node`` included), in graph order."""
        found = {m for root in self.roots[node] for m in self._members[root]}
        return sorted(found, key=self.order.__getitem__)

    def read_after(self, node: fx.Node, here: float) -> bool:
        return any(self.order.get(u, -1.0) > here and not _reads_metadata_only(u) for u in node.users)


def functionalize_inplace(gm: fx.GraphModule, registry: Registry) -> fx.GraphModule:
    """Make the in-place ops of ``gm`` out of place where that is exact; see the module docstring."""
    module_calls: Dict[str, List[bool]] = {}  # in-place module -> whether each call may drop the "in place"
    nodes = list(gm.graph.nodes)
    storage = _Storage(nodes)
    for node in nodes:
        written = _written(gm, node, registry)
        if written is None:
            storage.record(node, _may_alias(gm, node, registry))
            continue
        here = storage.order[node]
        family = storage.family(written)
        live = [n for n in family if n is not written and storage.read_after(n, here)]
        why = _who_sees(written, storage.roots[written], live)
        later = [u for u in written.users if storage.order.get(u, -1.0) > here]
        if why is None and node.op == "call_module":
            module_calls.setdefault(node.target, []).append(True)
        elif why is None and not _out_of_place(gm, node, registry):
            why = "has no out-of-place form lucid_fx knows; runs in place, in float"
        storage.record(node, [] if why is None else [written])
        if why is not None:
            if node.op == "call_module":
                module_calls.setdefault(node.target, []).append(False)
            node.meta[_meta.MUTATION] = why
            shares = f"shares storage with the value {node.name!r} changes in place; runs in float so the change reaches it"
            for member in family:
                if storage.views[member]:
                    member.meta.setdefault(_meta.MUTATION, shares)
            _read_after(gm, node, live, storage)
        for user in later:
            user.replace_input_with(written, node)
    for target, calls in module_calls.items():
        if all(calls):
            gm.get_submodule(target).inplace = False
    gm.graph.lint()
    gm.recompile()
    return gm


def _read_after(gm: fx.GraphModule, node: fx.Node, live: List[fx.Node], storage: _Storage) -> None:
    """Each view in ``live`` is read after ``node`` through a ``view_as`` written after ``node``."""
    point, here = node, storage.order[node]
    for k, member in enumerate(live, 1):
        with gm.graph.inserting_after(point):
            after = gm.graph.call_method("view_as", (member, member))
        after.meta[_meta.MUTATION] = f"reads {member.name!r} after {node.name!r} changed it in place"
        for user in list(member.users):
            if user is not after and storage.order.get(user, -1.0) > here:
                user.replace_input_with(member, after)
        storage.order[after] = here + k / (len(live) + 1)  # between node and the next node
        storage.record(after, [member])
        point = after
