"""run_program_natively: a program's calls run one after another from C++, not from its generated Python forward.

A program's forward is fx's generated Python: per call a line that reads the program's attributes, calls, and
drops what nothing reads later. Between two kernels, with the interpreter's caches cold (the last kernel filled
them with its data), each such line cost 3-8 us on an AMX Xeon, where the 5 us a call budget of issue 13 leaves no
room. This pass translates the program's graph into a ``NativeProgram`` of :mod:`lucid_fx.kernels.bound_ops` (C++)
and installs it as the program's ``forward``: the same calls, in the same order, on the same values, with the
registers nothing reads later dropped after each call, as the generated code drops them.

How each node runs (``NativeProgram``'s kinds):

- a bound oneDNN call (:mod:`lucid_fx.passes.bind_program_ops`): its ``BoundOp`` directly, no Python;
- a call of a function marked :func:`~lucid_fx.kernels.native_step.returns_step` (the planned kernel functions of
  :data:`lucid_fx.rules.program_cpu.PROGRAM_PLANS_CPU`: their result is their step's on the operands they name)
  and given a planned ``NativeStep`` (:mod:`lucid_fx.passes.plan_program_calls`): the step on those operands;
  where it refuses them, the function itself, whose checked path serves them (and raises, naming the node);
- a view op (``x.reshape(...)``, ``x.permute(...)``, ``x[0]``, ...), ``split_with_sizes``, ``addcmul`` or
  ``torch.layer_norm`` whose other arguments are constants (:data:`ATEN_CALLS`): its aten operator, bound;
- a float layer norm's function (:mod:`lucid_fx.passes.call_float_modules`, ``fn.unless_hooked``): its operator,
  bound, unless the module has hooks when it runs (then the function, which calls the module);
- any other call: the Python callable by vectorcall (torch functions, the kernels' Python functions, modules),
  a method by name on its first argument;
- a list or tuple of values an op takes, and the output's: packed.

The program's graph and code stay as they were: ``program.code`` shows what runs, and ``program.graph`` is what
the passes and tests read. Not installed (the generated forward runs) where the bound calls are not built
(``LUCID_FX_BOUND_OPS=0``, no C++ compiler), or the graph holds what the translation does not take: a forward with
the model's call structure (a torch.export graph's pytree), a dict or slice of values, an output other than one
value or a flat tuple or list of them.
"""

from __future__ import annotations

import inspect
import operator
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch import fx
from torch.fx.immutable_collections import immutable_list

from lucid_fx.kernels import bound_ops
from lucid_fx.passes.bind_program_ops import _CALL, bound_call
from lucid_fx.rules.aten_ops import bind_schema

__all__ = ["run_program_natively", "native_forward", "ATEN_CALLS"]

CALL, METHOD, BOUND, STEP, TUPLE, LIST, GUARDED = range(7)  # bound_ops.cpp's NativeProgram::Kind

_ATEN = torch.ops.aten
#: Calls a native program makes as bound aten operators (:func:`~lucid_fx.passes.bind_program_ops.bound_call`), where
#: their arguments but the tensors are constants: through torch's Python binding each parsed its arguments on every
#: call, 2-8 us between kernels with the interpreter's caches cold (the encoder's view ops, AMX Xeon, profiler gaps).
#: A Tensor method by name, or a function -> the operator its Python binding calls (``operator.getitem`` of a tensor
#: and an int: ``select``).
ATEN_CALLS: Dict[Any, torch._ops.OpOverload] = {
    "reshape": _ATEN.reshape.default, "view": _ATEN.view.default, "permute": _ATEN.permute.default,
    "transpose": _ATEN.transpose.int, "contiguous": _ATEN.contiguous.default, "flatten": _ATEN.flatten.using_ints,
    "clone": _ATEN.clone.default, "unsqueeze": _ATEN.unsqueeze.default,
    torch.reshape: _ATEN.reshape.default, torch.permute: _ATEN.permute.default, torch.transpose: _ATEN.transpose.int,
    torch.flatten: _ATEN.flatten.using_ints, torch.split_with_sizes: _ATEN.split_with_sizes.default,
    torch.addcmul: _ATEN.addcmul.default, torch.layer_norm: _ATEN.layer_norm.default, operator.getitem: _ATEN.select.int,
}
_SIZES = frozenset({"reshape", "view", "permute"})  # methods taking sizes as arguments too: x.view(2, 3) is x.view((2, 3))


class _Untranslatable(Exception):
    """The graph holds what NativeProgram does not run: the generated forward stays."""


class _Translation:
    def __init__(self, program: fx.GraphModule, module: Any) -> None:
        self.program, self.module = program, module
        self.registers: Dict[Any, int] = {}
        self.count = 0
        self.constants: List[Any] = []
        self.code: List[list] = []

    def register(self, node: Any = None) -> int:
        self.count += 1
        if node is not None:
            self.registers[node] = self.count - 1
        return self.count - 1

    def constant(self, value: Any) -> Tuple[int, int]:
        self.constants.append(value)
        return (1, len(self.constants) - 1)

    def arg(self, value: Any) -> Tuple[int, int]:
        """``value`` (a node, a literal, or a list or tuple holding nodes, packed first) as an argument."""
        if isinstance(value, fx.Node):
            if value.op == "get_attr":
                return self.constant(self.attribute(value.target))
            if value not in self.registers:
                raise _Untranslatable(f"{value.name} is read before it is computed")
            return (0, self.registers[value])
        nested: List[fx.Node] = []
        fx.node.map_arg(value, nested.append)
        if not nested:
            return self.constant(_plain(value))
        if type(value) not in (list, tuple, immutable_list):
            raise _Untranslatable(f"a {type(value).__name__} of values")  # a dict, a slice, a named tuple
        items = [self.arg(v) for v in value]
        out = self.register()
        self.code.append([LIST if isinstance(value, list) else TUPLE, None, items, (), out, []])
        return (0, out)

    def attribute(self, target: str) -> Any:
        value = self.program
        for part in target.split("."):
            value = getattr(value, part)
        return value

    def call(self, node: fx.Node) -> None:
        aten = self.aten(node)
        if aten is not None:  # a bound aten operator: only the values it takes per call are arguments
            self.code.append([BOUND, aten[0], [self.arg(n) for n in aten[1]], (), self.register(node), []])
            return
        args = [self.arg(a) for a in (*node.args, *node.kwargs.values())]
        kwnames = tuple(node.kwargs)
        guarded = self.guarded(node)
        if guarded is not None:
            kind, target = GUARDED, guarded
        elif node.op == "call_method":
            kind, target = METHOD, node.target
        elif node.op == "call_module":
            kind, target = CALL, self.attribute(node.target)
        elif node.target is _CALL and isinstance(self.value(node.args[0]), self.module.BoundOp) and not kwnames:
            kind, target, args = BOUND, self.value(node.args[0]), args[1:]
        else:
            kind, target = CALL, node.target
            step = self.planned(node)
            if step is not None:
                kind, target = STEP, (step[0], node.target, step[1])
        self.code.append([kind, target, args, kwnames, self.register(node), []])

    def aten(self, node: fx.Node) -> Optional[Tuple[Any, List[fx.Node]]]:
        """A call of :data:`ATEN_CALLS` as its bound operator, and the values it takes per call; None to keep it."""
        op = ATEN_CALLS.get(node.target) if node.op in ("call_method", "call_function") else None
        args = None if op is None else _aten_args(node, op)
        found = None if args is None else bound_call(self.program, op, args)
        return None if found is None else found[:2]

    def guarded(self, node: fx.Node) -> Optional[tuple]:
        """For a call of a float module's function (``fn.unless_hooked = (module parameter, operator, its parameters)``,
        :mod:`lucid_fx.passes.call_float_modules`): (the bound operator, the function, where its operands are among the
        call's arguments, the module)."""
        module_name, op, names = getattr(node.target, "unless_hooked", (None, None, ()))
        if module_name is None:
            return None
        where, given = self.where(node)
        if module_name not in where or not all(name in where for name in names):
            return None
        module, args = self.value(given[where[module_name]]), [given[where[name]] for name in names]
        found = None if module is None else bound_call(self.program, op, _with_defaults(op, args, {}))
        if found is None:
            return None
        live = [name for name in names if isinstance(given[where[name]], fx.Node) and given[where[name]].op != "get_attr"]
        return found[0], node.target, [where[name] for name in live], module

    def where(self, node: fx.Node) -> Tuple[Dict[str, int], tuple]:
        """Each of the called function's parameters given by the call -> its index among the call's arguments
        (positional, then keyword values); and those arguments."""
        names = list(inspect.signature(node.target).parameters)
        where = {name: i for i, name in enumerate(names[:len(node.args)])}
        where.update((name, len(node.args) + i) for i, name in enumerate(node.kwargs))
        return where, (*node.args, *node.kwargs.values())

    def planned(self, node: fx.Node) -> Optional[Tuple[Any, List[int]]]:
        """For a call of a :func:`~lucid_fx.kernels.native_step.returns_step` function given a ``NativeStep``: the step,
        and where its operands are among the call's arguments (positional, then keyword values)."""
        step_name, operands = getattr(node.target, "returns_step", (None, ()))
        if step_name is None:
            return None
        where, given = self.where(node)
        step = self.value(given[where[step_name]]) if step_name in where else None
        if not isinstance(step, self.module.NativeStep) or not all(name in where for name in operands):
            return None
        return step, [where[name] for name in operands]

    def value(self, arg: Any) -> Any:
        return self.attribute(arg.target) if isinstance(arg, fx.Node) and arg.op == "get_attr" else None


def _translate(program: fx.GraphModule, module: Any) -> Any:
    graph = program.graph
    if type(graph._codegen) is not fx.graph.CodeGen:
        raise _Untranslatable("a forward with the model's call structure")
    t = _Translation(program, module)
    placeholders = list(graph.find_nodes(op="placeholder"))
    names, defaults, has_default = [], [], []
    for node in placeholders:
        t.register(node)
        if node.target.startswith("*"):
            raise _Untranslatable("a forward taking *args")
        names.append(node.target)
        has_default.append(bool(node.args))
        defaults.append(node.args[0] if node.args else None)
    output = None
    for node in graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            t.call(node)
        elif node.op == "output":
            output = t.arg(node.args[0])
    _drop_after_last_read(t.code, output)
    return module.NativeProgram(names, defaults, has_default, t.count, t.constants, t.code, output)


def _drop_after_last_read(code: List[list], output: Tuple[int, int]) -> None:
    """Each instruction drops the registers of the values it is the last to read, and its own where nothing reads
    it; never the output's."""
    last: Dict[int, int] = {}  # register -> the last instruction reading (or else writing) it
    for index, (_, _, args, _, out, _) in enumerate(code):
        last.setdefault(out, index)
        for source, register in args:
            if source == 0:
                last[register] = index
    for register, index in last.items():
        if output != (0, register):
            code[index][5].append(register)


def _aten_args(node: fx.Node, op: torch._ops.OpOverload) -> Optional[tuple]:
    """``node``'s arguments as ``op``'s schema takes them (one per argument, defaults filled in); None where they are
    not ``op``'s (a tensor's ``view(dtype)`` fails later, in binding)."""
    args = list(node.args)
    if op is _ATEN.select.int:  # x[i]: of a tensor (a list's item stays operator.getitem) and an int only
        value = args[0].meta.get("val") if isinstance(args[0], fx.Node) else None
        return (args[0], 0, args[1]) if isinstance(value, torch.Tensor) and type(args[1]) is int else None
    if node.op == "call_method" and node.target in _SIZES and not (len(args) == 2 and isinstance(args[1], (list, tuple))):
        args = [args[0], list(args[1:])]
    return _with_defaults(op, args, node.kwargs)


def _with_defaults(op: torch._ops.OpOverload, args: List[Any], kwargs: Dict[str, Any]) -> Optional[tuple]:
    """``args`` and ``kwargs`` as one value per argument of ``op``'s schema (:func:`~lucid_fx.rules.aten_ops.bind_schema`,
    defaults filled in); None where they do not bind."""
    schema = op._schema.arguments
    if len(args) > sum(not a.kwarg_only for a in schema) or set(kwargs) - {a.name for a in schema}:
        return None
    bound = bind_schema(op, tuple(args), kwargs)
    return tuple(bound[a.name] for a in schema) if len(bound) == len(schema) else None


def _plain(value: Any) -> Any:
    """fx's immutable lists in a node's arguments as the plain lists the generated code builds."""
    if type(value) in (immutable_list, list, tuple):
        return type(value)(_plain(v) for v in value) if type(value) is tuple else [_plain(v) for v in value]
    return value


def native_forward(program: fx.GraphModule) -> Optional[Any]:
    """The ``NativeProgram`` running ``program``'s graph, or None where the bound calls are not built or the graph
    holds what it does not run."""
    module = bound_ops.module()
    if module is None:
        return None
    try:
        return _translate(program, module)
    except _Untranslatable:
        return None
    except (RuntimeError, TypeError) as error:  # NativeProgram's own checks: a marked function whose step disagrees
        warnings.warn(f"lucid_fx: this program runs its generated forward, not from C++ ({error})", RuntimeWarning,
                      stacklevel=2)
        return None


def run_program_natively(program: fx.GraphModule) -> bool:
    """Install ``program``'s ``NativeProgram`` as its forward (in place); whether it was."""
    forward = native_forward(program)
    if forward is None:
        return False
    program.__dict__["forward"] = forward
    return True
