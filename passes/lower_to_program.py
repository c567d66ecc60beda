"""lower_to_program: the portable int8 graph becomes a program of the target's own calls.

The portable graph (``torch.ops.lucid_fx.*`` calls: what convert returns, what save/load stores, what
the viewer and compare read) is copied, the shapes, dtypes and strides its values had on one real run
(:func:`record_values`) are written as ``node.meta["val"]`` on the copy only, and each call is
rewritten by the target's program rules (:data:`lucid_fx.rules.program_cpu.PROGRAM_RULES_CPU`):
prepacked weights, zero points folded, routes and layouts chosen, all once. A call no rule takes is
made to its device kernel function directly, skipping the dispatcher (~10 us a call) and the input
checks, which the program's fixed input signature makes redundant. The call that computes a
portable node's value keeps its name and ``node.meta`` (``SOURCE``, ``QPARAMS``, ...), so errors and
inspection name the portable nodes.

The program holds packed oneDNN weights, which cannot be copied or pickled: it is never state. It is
built per input signature and rebuilt on a copy, after ``.to()`` or ``load_state_dict``, and at load
(:mod:`lucid_fx.program`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch import fx

from lucid_fx.kernels.library import KERNELS, op_name
from lucid_fx.passes.bind_program_ops import bind_program_ops
from lucid_fx.passes.call_float_modules import call_float_modules
from lucid_fx.passes.fold_signature_constants import fold_signature_constants, kept_by_dead_code_elimination
from lucid_fx.passes.merge_program_linears import drop_unread_merged, merge_program_linears
from lucid_fx.passes.merge_program_views import merge_program_views
from lucid_fx.passes.plan_program_calls import plan_program_calls
from lucid_fx.passes.run_program_natively import run_program_natively
from lucid_fx.rules.program_cpu import PROGRAM_PLANS_CPU, PROGRAM_RULES_CPU

__all__ = ["lower_to_program", "record_values", "ProgramBuilder", "PROGRAM_RULES", "PROGRAM_PLANS"]

#: Program rules per device type; a device without rules gets direct kernel calls only.
PROGRAM_RULES: Dict[str, Dict[str, Callable]] = {"cpu": PROGRAM_RULES_CPU}
#: Planners per device type (passes/plan_program_calls.py): a kernel function -> its ``*_plan`` twin.
PROGRAM_PLANS: Dict[str, Dict[Callable, Callable]] = {"cpu": PROGRAM_PLANS_CPU}
_LUCID = torch.ops.lucid_fx


class ProgramBuilder:
    """What a program rule may use: the program graph being rewritten, the values' fake tensors, the
    portable model's constants, and a place for new constants (plain attributes: never state)."""

    def __init__(self, program: fx.GraphModule, device: str) -> None:
        self.gm, self.graph, self.device = program, program.graph, device
        self._order = {n: i for i, n in enumerate(self.graph.nodes)}
        self._current: Optional[fx.Node] = None
        self._constants = 0
        self._portable_ops: Dict[fx.Node, str] = {}  # program node -> the lucid_fx op it computes

    # -- reading ------------------------------------------------------------------------------
    def value(self, node: Any) -> Any:
        """The fake value ``node`` computes (shape, dtype, strides), or the constant itself."""
        return node.meta.get("val") if isinstance(node, fx.Node) else node

    def attr(self, node: Any) -> Optional[torch.Tensor]:
        """The tensor a ``get_attr`` node reads from the portable model (None for anything else)."""
        if not (isinstance(node, fx.Node) and node.op == "get_attr"):
            return None
        value = self.gm
        for part in node.target.split("."):
            value = getattr(value, part)
        return value

    def op_name(self, node: Any) -> Optional[str]:
        """``"linear"`` for a call of ``torch.ops.lucid_fx.linear`` or the program node now computing it, else None."""
        return op_name(node) or self._portable_ops.get(node)

    def read_later(self, value: fx.Node, node: fx.Node) -> bool:
        """Whether anything reads ``value`` after ``node`` (or it is an input or output of the model)."""
        if value.op in ("placeholder", "get_attr"):  # an input, or a constant every call reads
            return True
        return any(u is not node and (u.op == "output" or self._order.get(u, -1) > self._order[node]) for u in value.users)

    def defined_before(self, value: fx.Node, node: fx.Node) -> bool:
        """Whether ``value`` is computed before ``node`` (a call a rule inserted is, before its own node)."""
        return self._order.get(value, -1) < self._order[node]

    def kernel(self, name: str) -> Callable:
        """The device kernel function of ``lucid_fx::name`` (its reference kernel where none is registered)."""
        kernels = KERNELS[name]
        return kernels.get(self.device, kernels["default"])

    # -- emitting -----------------------------------------------------------------------------
    def const(self, value: Any, hint: str) -> fx.Node:
        self._constants += 1
        name = f"_program_{hint}_{self._constants}"
        self.gm.__dict__[name] = value  # a plain attribute, not a buffer: packed oneDNN weights are not state
        with self.graph.inserting_before(self._current):
            return self.graph.create_node("get_attr", name)  # (graph.get_attr warns: it looks for state only)

    def call(self, target: Callable, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self._current):
            return self.graph.call_function(target, args, kwargs)

    def call_method(self, name: str, *args: Any, **kwargs: Any) -> fx.Node:
        with self.graph.inserting_before(self._current):
            return self.graph.call_method(name, args, kwargs)

    # -- the rewrite ----------------------------------------------------------------------------
    def rewrite(self, rules: Dict[str, Callable]) -> None:
        for node in list(self.graph.nodes):
            name = op_name(node)
            if name is None:
                continue
            self._current = node
            rule = rules.get(name)
            new = rule(self, node) if rule is not None else None
            if new is None:
                new = self.call(self.kernel(name), *node.args, **node.kwargs)
            new.meta = dict(node.meta)
            self._portable_ops[new] = name
            node.replace_all_uses_with(new)
            name = node.name
            self.graph.erase_node(node)
            new.name = name  # errors name the portable node (the namespace keeps the name reserved)
        self.graph.eliminate_dead_code(is_impure_node=kept_by_dead_code_elimination)


class _Recorder(fx.Interpreter):
    """Runs the portable graph (its kernels check their inputs) and keeps each tensor value's shape,
    strides and dtype as a tensor on the meta device: what program rules read, without the data."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.values: Dict[str, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        out = super().run_node(n)
        if isinstance(out, torch.Tensor):
            self.values[n.name] = torch.empty_strided(out.shape, out.stride(), dtype=out.dtype, device="meta")
        return out


def record_values(portable: fx.GraphModule, inputs: Tuple[Any, ...]) -> Tuple[Any, Dict[str, Any]]:
    """``portable(*inputs)`` and, by node name, a meta tensor like each tensor value it computed."""
    recorder = _Recorder(portable)
    flat_call = getattr(portable.graph._codegen, "flat_call", None)  # forward with the model's signature
    if flat_call is not None:
        inputs = tuple(flat_call(inputs, {}))  # the placeholders' values, the graph's input checks made
    return recorder.run(*inputs), recorder.values


def _flat_attributes(program: fx.GraphModule) -> None:
    """Read each submodule's tensor (a float layer norm's weight: ``self.encoder.layer[0]...weight``)
    as a plain attribute of the program, the same tensor object: each step of the dotted path was a
    ``Module.__getattr__`` per call (BERT-like: 60 a forward, ~0.4 us each). An edit in place reaches
    the program as before; a tensor assigned anew, only through ``recompile`` (as every program constant)."""
    for node in program.graph.find_nodes(op="get_attr"):
        if "." not in node.target:
            continue
        value = functools.reduce(getattr, node.target.split("."), program)
        if not isinstance(value, torch.Tensor):
            continue
        name = "_program_attr_" + node.target.replace(".", "_")
        program.__dict__[name] = value
        node.target = name
    program.delete_all_unused_submodules()


def lower_to_program(portable: fx.GraphModule, values: Dict[str, Any], device: str = "cpu") -> fx.GraphModule:
    """The program of ``portable`` on ``device`` for the input signature ``values`` were recorded on
    (:func:`record_values`); its native calls are planned on its first call
    (:func:`~lucid_fx.passes.plan_program_calls.plan_program_calls`), and then it runs from C++
    (:func:`~lucid_fx.passes.run_program_natively.run_program_natively`)."""
    graph = fx.Graph()
    out = graph.graph_copy(portable.graph, {})
    graph.output(out)
    graph.set_codegen(portable.graph._codegen)  # a torch.export graph's call and result structure (pytree)
    program = fx.GraphModule(portable, graph, "Program")
    for node in program.graph.nodes:
        if node.name in values:
            node.meta["val"] = values[node.name]
    fold_signature_constants(program, values)
    merge_program_linears(program)
    builder = ProgramBuilder(program, device)
    builder.rewrite(PROGRAM_RULES.get(device, {}))
    drop_unread_merged(program)
    merge_program_views(program)
    call_float_modules(program)
    _flat_attributes(program)
    bind_program_ops(program)
    program.graph.lint()
    program.recompile()
    plan_program_calls(program, PROGRAM_PLANS.get(device, {}), then=run_program_natively)
    return program
