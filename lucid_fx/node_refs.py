"""References between nodes in ``node.meta``, by name, and the bound view rules read.

``node.meta[OP]`` (a :class:`CanonicalCall`) names the nodes its arguments are with
:class:`NodeRef`, so it holds no ``fx.Node``: a deep copy of a graph, or a saved and loaded one,
needs no rebinding. :func:`canonical` gives a rule the call with those names resolved to the nodes
of the node's own graph.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Union

import torch
from torch import fx

from lucid_fx._meta import OP as _OP

__all__ = ["NodeRef", "BoundCall", "CanonicalCall", "canonical", "layer_groups", "attr_value", "scalar_constant",
           "call_name", "writes_in_place", "pure_call", "unstable_name"]


@dataclass(frozen=True)
class NodeRef:
    """Another node of the same graph, by name (node names are unique in a graph)."""

    name: str


def each(value: Any, fn: Callable[[Any], Any]) -> Any:
    """``fn`` of ``value``, or of each item of a list or tuple ``value`` (one level, as node args nest)."""
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(fn(v) for v in value)
    return fn(value)


def as_ref(value: Any) -> Any:
    return NodeRef(value.name) if isinstance(value, fx.Node) else value


def node_named(graph: fx.Graph, ref: NodeRef) -> Any:
    """The node of ``graph`` that ``ref`` names (looked up in a table kept on the graph, rebuilt
    when it misses or is stale), or ``ref`` itself when the graph has no such node."""
    table = graph.__dict__.get("_lucid_fx_nodes_by_name")
    node = table.get(ref.name) if table is not None else None
    if node is None or node.graph is not graph or node.name != ref.name or getattr(node, "_erased", False):
        table = {n.name: n for n in graph.nodes}
        graph.__dict__["_lucid_fx_nodes_by_name"] = table
        node = table.get(ref.name)
    return node if node is not None else ref


@dataclass(frozen=True)
class BoundCall:
    """A canonical call read in its graph: the arguments that are nodes are ``fx.Node`` s."""

    op: str
    args: Mapping[str, Any]
    inplace: bool
    spelling: str
    module: Optional[str] = None

    def tensor_inputs(self) -> List[fx.Node]:
        found: List[fx.Node] = []
        for value in self.args.values():
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, fx.Node) and item not in found:
                    found.append(item)
        return found


@dataclass(frozen=True)
class CanonicalCall:
    """A node's op in canonical form: op name, arguments by canonical name, and the spelling seen.

    ``node.meta[OP]`` stores it with each argument that is a node as a :class:`NodeRef` (a node
    given here is stored as one); rules read it through :func:`canonical` (lucid_fx/node_refs.py)."""

    op: str
    args: Mapping[str, Union[NodeRef, Any]]
    inplace: bool
    spelling: str
    module: Optional[str] = None  # qualified name, for call_module spellings

    def __post_init__(self) -> None:
        if isinstance(self.args, Mapping):  # anything else: load's type check names it
            object.__setattr__(self, "args", {k: each(v, as_ref) for k, v in self.args.items()})

    def replace_input(self, old: fx.Node, new: fx.Node) -> "CanonicalCall":
        """The same call with every reference to ``old`` naming ``new`` (for graph rewrites)."""
        old_ref, new_ref = NodeRef(old.name), NodeRef(new.name)
        swap = lambda v: new_ref if v == old_ref else v  # noqa: E731
        args = {k: each(v, swap) for k, v in self.args.items()}
        return CanonicalCall(self.op, args, self.inplace, self.spelling, self.module)

    def bind(self, graph: fx.Graph) -> "BoundCall":
        """This call with each :class:`NodeRef` resolved to the node of ``graph`` it names."""
        resolve = lambda v: node_named(graph, v) if isinstance(v, NodeRef) else v  # noqa: E731
        args = {k: each(v, resolve) for k, v in self.args.items()}
        return BoundCall(self.op, args, self.inplace, self.spelling, self.module)


def canonical(node: fx.Node) -> Optional[BoundCall]:
    """``node``'s canonical call (``node.meta[OP]``) with its node arguments as the nodes of
    ``node``'s graph, or None when canonicalize_ops gave it none.

    >>> import torch
    >>> from torch import fx
    >>> from lucid_fx.ops import CanonicalCall
    >>> graph = fx.Graph()
    >>> x = graph.placeholder("x")
    >>> y = graph.call_function(torch.sigmoid, (x,))
    >>> y.meta[_OP] = CanonicalCall("sigmoid", {"input": x}, False, "torch.sigmoid")
    >>> y.meta[_OP].args, canonical(y).args["input"] is x
    ({'input': NodeRef(name='x')}, True)
    """
    call = node.meta.get(_OP)
    return call.bind(node.graph) if call is not None else None


def layer_groups(gm: fx.GraphModule, node: fx.Node) -> int:
    """The groups a weighted layer ``node`` splits its channels into (a convolution module's or
    function's ``groups``); 1 for any other layer, or where the graph computes it."""
    if node.op == "call_module":
        groups = getattr(gm.get_submodule(node.target), "groups", 1)
    else:
        call = canonical(node)
        groups = call.args.get("groups", 1) if call is not None else 1
    return groups if isinstance(groups, int) else 1


#: The starts of words in a call's name that mark a value that differs per call (random ops, uninitialised
#: memory: ``randn_like``, ``dropout2d``, ``normal_``, ``empty``), and whole words that do (``normal``, not ``normalize``).
UNSTABLE_NAMES = ("rand", "dropout", "bernoulli", "multinomial", "poisson", "uniform", "empty", "seed", "exponential", "cauchy")
UNSTABLE_WORDS = frozenset({"normal", "geometric"})


def unstable_name(name: str) -> bool:
    """Whether a call named ``name`` may give another value on every call (:data:`UNSTABLE_NAMES`)."""
    words = name.lower().strip("_").split("_")
    return any(w.startswith(UNSTABLE_NAMES) or w in UNSTABLE_WORDS for w in words)


def call_name(node: fx.Node) -> str:
    """The name ``node`` calls: a method's, a function's ``__name__``, an aten overload's schema name."""
    target = node.target
    if isinstance(target, str):
        return target
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::")[-1]
    return getattr(target, "__name__", str(target))


def writes_in_place(node: fx.Node) -> bool:
    """Whether ``node`` writes into its first argument."""
    name = call_name(node)
    if node.target is operator.setitem or node.kwargs.get("inplace") is True or node.kwargs.get("out") is not None:
        return True
    if isinstance(node.target, torch._ops.OpOverload) and node.target._schema.is_mutable:
        return True
    return node.op in ("call_method", "call_function") and name.endswith("_") and not name.startswith("_")


def pure_call(node: fx.Node) -> bool:
    """Whether ``node`` calls a function or method that gives the same value for the same inputs and writes
    nothing: no child module (it may keep state), no impure, in-place or random call."""
    if node.op not in ("call_function", "call_method") or node.is_impure() or writes_in_place(node):
        return False
    return not unstable_name(call_name(node))


def attr_value(node: Any) -> Any:
    """What a ``get_attr`` node reads from its graph's module; None for any other value."""
    if not (isinstance(node, fx.Node) and node.op == "get_attr"):
        return None
    value = node.graph.owning_module
    for part in node.target.split("."):
        value = getattr(value, part, None)
    return value


def scalar_constant(value: Any) -> Any:
    """``value`` where it is no node; the number a 0-dim float constant (a ``get_attr``) holds (GPT-2 divides its
    scores by ``torch.full([], d ** 0.5)``, which prepare keeps as a constant); else None."""
    if not isinstance(value, fx.Node):
        return value
    tensor = attr_value(value)
    ok = isinstance(tensor, torch.Tensor) and tensor.dim() == 0 and tensor.is_floating_point()
    return float(tensor.detach()) if ok else None  # a 0-dim parameter (a learned temperature) too
