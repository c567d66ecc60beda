"""call_float_modules: a program calls its float layer norms' functions, not the modules.

A float ``nn.LayerNorm`` left in a converted graph (an encoder's norms, which lucid_fx keeps in float) is a
``call_module``: ``Module.__call__``, ``LayerNorm.forward`` and ``F.layer_norm``, three Python frames before
``torch.layer_norm``. Between kernels, with the interpreter's caches cold, calling the function instead took 23 us
off each of the encoder block's two gaps into its norms (benchmarks/models.py, AMX Xeon, profiler gaps: 55.6 ->
32.9 and 36.5 -> 13.2 us). The program calls :func:`layer_norm` instead: the
same ``torch.layer_norm`` call ``F.layer_norm`` makes, so the same values, on the module's weight and bias read once
(a tensor assigned anew reaches the program through ``recompile``, as every program constant), and the module's own
call where it has hooks when the program runs. Only modules of exactly these types (a subclass may override
``forward``): :data:`FLOAT_MODULE_CALLS`, module type -> the function and the module's attributes it takes.
"""

from __future__ import annotations

from typing import Callable, Dict, Tuple

import torch
from torch import fx, nn

__all__ = ["call_float_modules", "layer_norm", "FLOAT_MODULE_CALLS"]


def layer_norm(x: torch.Tensor, module: nn.LayerNorm, shape: Tuple[int, ...], weight, bias, eps: float) -> torch.Tensor:
    """``module(x)``: ``torch.layer_norm`` as ``F.layer_norm`` calls it, or the module's call where it has hooks."""
    if module._forward_hooks or module._forward_pre_hooks:
        return module(x)
    return torch.layer_norm(x, shape, weight, bias, eps)


# A native program (passes/run_program_natively.py) calls the operator on these parameters itself, unless the module
# has hooks: (the module's parameter, the operator torch.layer_norm calls, its arguments' parameters).
layer_norm.unless_hooked = ("module", torch.ops.aten.layer_norm.default, ("x", "shape", "weight", "bias", "eps"))


#: A float module's type -> (the function a program calls instead, the module attributes it takes after the module).
FLOAT_MODULE_CALLS: Dict[type, Tuple[Callable, Tuple[str, ...]]] = {
    nn.LayerNorm: (layer_norm, ("normalized_shape", "weight", "bias", "eps")),
}


def call_float_modules(program: fx.GraphModule) -> int:
    """Rewrite ``program``'s calls of :data:`FLOAT_MODULE_CALLS` modules (in place); how many."""
    rewritten = 0
    for node in list(program.graph.find_nodes(op="call_module")):
        module = program.get_submodule(node.target)
        entry = FLOAT_MODULE_CALLS.get(type(module))
        if entry is None or len(node.args) != 1 or node.kwargs:
            continue
        fn, names = entry
        attr = f"_program_{node.target.replace('.', '_')}_module"
        program.__dict__[attr] = module  # a plain attribute: no Module.__getattr__ per call
        with program.graph.inserting_before(node):
            # a tensor as a dotted get_attr, which lower_to_program's _flat_attributes makes a plain attribute
            operands = [program.graph.create_node("get_attr", f"{node.target}.{name}")
                        if isinstance(getattr(module, name), torch.Tensor) else getattr(module, name) for name in names]
            call = program.graph.call_function(fn, (node.args[0], program.graph.create_node("get_attr", attr),
                                                    *operands))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        program.graph.erase_node(node)
        call.name = node.name
        rewritten += 1
    return rewritten
