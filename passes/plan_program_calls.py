"""plan_program_calls: a program's native calls get their checks, shapes and scalar arguments made once.

A native kernel's Python function checks its operands, allocates its result and converts a dozen scalars for
ctypes on every call: 5.2 us for squeeze-excite's gate multiply of 1x8x2x2 codes, 2.1 of them ctypes' 13 arguments. A
program meets one input signature, so each call whose function has a *planner* (a table,
:data:`lucid_fx.rules.program_cpu.PROGRAM_PLANS_CPU`: the function -> its ``*_plan`` twin, which takes the same
arguments) is planned once, as the program's first call runs interpreted (no extra run: a program may write a
buffer in place, once a call): the planner sees the real operands and returns a step
with the scalars bound (:func:`lucid_fx.kernels.native.bind`) and the result's shape and strides fixed, or None
where the native kernel does not take them. The step is the call's ``plan`` keyword (a program attribute: the
code reads ``gate_mul_codes(..., plan=self._program_step_12)``); the function calls it first, and a step
refuses, returning None, operands whose strides or dtype differ from the ones it was planned for, so the
function's checked path serves them instead.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict

import torch
from torch import fx

__all__ = ["plan_program_calls"]


class _Planner(fx.Interpreter):
    """Runs a call of the program; before each call of a function with a planner, plans it on the operands it meets."""

    def __init__(self, program: fx.GraphModule, planners: Dict[Callable, Callable]) -> None:
        super().__init__(program)
        self.planners, self.planned = planners, 0

    def run_node(self, n: fx.Node) -> Any:
        planner = self.planners.get(n.target) if n.op == "call_function" and "plan" not in n.kwargs else None
        if planner is not None:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            plan = planner(*args, **kwargs)
            if plan is not None:
                self.planned += 1
                name = f"_program_step_{self.planned}"
                while hasattr(self.module, name):
                    name += "_"
                self.module.__dict__[name] = plan  # a plain attribute, as the program's other constants
                with self.module.graph.inserting_before(n):
                    n.kwargs = {**n.kwargs, "plan": self.module.graph.create_node("get_attr", name)}
                self.env[n.kwargs["plan"]] = plan
        return super().run_node(n)


def plan_program_calls(program: fx.GraphModule, planners: Dict[Callable, Callable],
                       then: Callable[[fx.GraphModule], Any] = lambda program: None) -> bool:
    """Make ``program``'s next call plan its calls (in place) as it runs, then recompile it and call ``then(program)``
    (at once where it has no call to plan); whether it has a call to plan. Planning runs the program on a real call's
    inputs, never on an extra run: a program that writes a buffer in place (a counter) must write it once a call."""
    if not any(n.op == "call_function" and n.target in planners for n in program.graph.nodes):
        then(program)
        return False
    lock = threading.Lock()

    def forward(*inputs: Any) -> Any:  # the instance's forward until planned: then the class's, recompiled
        with lock:
            if "forward" not in program.__dict__:  # another thread planned it meanwhile
                return program.forward(*inputs)
            flat_call = getattr(program.graph._codegen, "flat_call", None)  # forward with the model's signature
            planner = _Planner(program, planners)
            try:
                with torch.no_grad():
                    out = planner.run(*(flat_call(inputs, {}) if flat_call is not None else inputs))
            finally:  # the calls planned so far stay planned, even where the run raised (the next call plans the rest)
                if planner.planned:
                    program.graph.lint()
                    program.recompile()
            del program.__dict__["forward"]
            then(program)
            return out

    program.__dict__["forward"] = forward
    return True
