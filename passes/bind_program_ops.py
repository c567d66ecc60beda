"""bind_program_ops: a program calls its oneDNN operators through bound calls, their constants converted once.

A program's oneDNN convolution is ``torch.ops.onednn.qconv2d_pointwise.default(x, x_scale, x_zp, packed, ...)``:
four program attributes read, then 17 arguments converted to the operator's schema by the dispatcher's boxed
call from Python, on every call, where all but ``x`` (and a residual) are the same on every call of a program.
Each such call becomes a :func:`~lucid_fx.kernels.bound_ops.bind` call, ``operator.call(self._program_bound_3, x)``,
holding the other arguments converted (the packed weights the same tensors). Same operator, same dispatcher call,
same values. Measured (AMX Xeon, 1 thread, benchmarks/overhead.py, time outside kernels per forward): ResNet-like
508 -> 292 us, EfficientNet-like 1890 -> 1261, MobileNetV3-like 925 -> 619.

Which calls: those of :data:`BOUND_NAMESPACES` (operators torch offers Python only through the boxed call; aten's
have generated bindings), positional, returning one tensor, whose tensor arguments are program attributes
(constants) or values of the graph (passed per call). Others, and every call where the bound calls are not built
(:func:`lucid_fx.kernels.bound_ops.status`), keep ``torch.ops``. A bound node keeps the operator in
``node.meta[BOUND_OP]`` (lucid_fx/_meta.py), a :class:`BoundCall`, so a reader of the program still sees which
operator runs, on what.
"""

from __future__ import annotations

import operator
from typing import Any, Callable, NamedTuple, Tuple

import torch
from torch import fx

from lucid_fx._meta import BOUND_OP
from lucid_fx.kernels import bound_ops

__all__ = ["bind_program_ops", "bound_call", "BoundCall", "BOUND_NAMESPACES"]

#: Operator namespaces whose program calls are bound.
BOUND_NAMESPACES = frozenset({"onednn"})


class BoundCall(NamedTuple):
    """What a bound call runs, for a reader of the program (``node.meta[BOUND_OP]``): the operator and its
    arguments as the ``torch.ops`` call had them, a constant as its value, a value of the graph as its node."""

    op: torch._ops.OpOverload
    args: Tuple[Any, ...]


def _call(fn: Callable, *args: Any) -> Any:
    return fn(*args)


_CALL = getattr(operator, "call", _call)  # Python 3.11's operator.call: no Python frame of its own


def bound_call(program: fx.GraphModule, op: torch._ops.OpOverload, args: Tuple[Any, ...]) -> Any:
    """The bound call of ``op`` on ``args`` (one per argument of its schema: constants, program attributes, values of
    the graph), the nodes it takes per call, and its arguments as :class:`BoundCall` keeps them; None to keep ``op``'s
    own call."""
    values: list = []
    slots, live = [], []
    for index, arg in enumerate(args):
        if isinstance(arg, fx.Node) and arg.op == "get_attr":
            values.append(getattr(program, arg.target))  # a constant: converted now
        elif isinstance(arg, fx.Node):  # a value of the graph: passed per call (the schema's argument a tensor)
            slots.append(index)
            live.append(arg)
            values.append(None)
        else:
            nested: list = []
            fx.node.map_arg(arg, nested.append)
            if nested:  # a list of graph values (a Tensor[] argument): kept
                return None
            values.append(arg)
    bound = bound_ops.bind(op, values, slots)
    if bound is None:
        return None
    return bound, live, tuple(a if i in slots else v for i, (a, v) in enumerate(zip(args, values)))


def bind_program_ops(program: fx.GraphModule) -> int:
    """Rewrite ``program``'s calls of :data:`BOUND_NAMESPACES` operators as bound calls (in place); how many."""
    rewritten = 0
    for node in [n for n in program.graph.nodes if n.op == "call_function"]:
        op = node.target
        if not isinstance(op, torch._ops.OpOverload) or op.namespace not in BOUND_NAMESPACES or node.kwargs:
            continue
        found = bound_call(program, op, node.args)
        if found is None:
            continue
        bound, live, args = found
        constants = dict.fromkeys(a for a in node.args if isinstance(a, fx.Node) and a.op == "get_attr")
        attr = f"_program_bound_{node.name}"
        program.__dict__[attr] = bound  # a plain attribute: no Module.__getattr__ per call
        with program.graph.inserting_before(node):
            call = program.graph.call_function(_CALL, (program.graph.create_node("get_attr", attr), *live))
        call.meta = {**node.meta, BOUND_OP: BoundCall(op, args)}
        node.replace_all_uses_with(call)
        program.graph.erase_node(node)
        call.name = node.name
        for constant in constants:  # the bound call holds them
            if not constant.users:
                program.graph.erase_node(constant)
        rewritten += 1
    return rewritten
