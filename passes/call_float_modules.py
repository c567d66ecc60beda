"""call_float_modules: a program calls its float layer norms' functions, not the modules.

A float ``nn.LayerNorm`` left in a converted graph (an encoder's norms, which lucid_fx keeps in float) is a
``call_module``: ``Module.__call__``, ``LayerNorm.forward`` and ``F.layer_norm``, three Python frames before
``torch.layer_norm``. Between kernels, with the interpreter's caches cold, that took 20-35 us of each call on the
encoder block of benchmarks/models.py (AMX Xeon, profiler gaps). The program calls :func:`layer_norm` instead: the
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
        operands = []
        for name in ("module", *names):
            value = module if name == "module" else getattr(module, name)
            if isinstance(value, (torch.Tensor, nn.Module)):
                attr = f"_program_{node.target.replace('.', '_')}_{name}"
                program.__dict__[attr] = value  # a plain attribute: no Module.__getattr__ per call
                with program.graph.inserting_before(node):
                    value = program.graph.create_node("get_attr", attr)
            operands.append(tuple(value) if isinstance(value, list) else value)
        with program.graph.inserting_before(node):
            call = program.graph.call_function(fn, (node.args[0], *operands))
        call.meta = dict(node.meta)
        node.replace_all_uses_with(call)
        program.graph.erase_node(node)
        call.name = node.name
        rewritten += 1
    return rewritten
