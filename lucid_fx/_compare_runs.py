"""How compare runs the two models: batches as (positional, keyword) calls, each submodule's
first call recorded (the inputs its part of the graph receives), and a graph run node by node
with the values of the nodes wanted copied out."""

from __future__ import annotations

import inspect
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch import fx, nn

from lucid_fx._pytree_spec import has_pytree_codegen
from lucid_fx.passes.export_model import call_inputs

__all__ = ["batches_of", "capture_calls", "Recorder", "run_recorded"]


def batches_of(inputs: Any) -> List[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
    """(positional, keyword) arguments of each batch: a tensor, a tuple of positional arguments or a
    dict of keyword arguments is one batch; a list of those is many."""
    def call(batch: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
        if isinstance(batch, dict):
            return (), dict(batch)
        return (batch if isinstance(batch, tuple) else (batch,)), {}

    if isinstance(inputs, list):
        if not inputs:
            raise ValueError("compare needs at least one batch of inputs; got an empty list")
        return [call(b) for b in inputs]
    return [call(inputs)]


def capture_calls(model: nn.Module, paths: Sequence[str], args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Tuple[Any, Dict[str, Tuple[tuple, dict]]]:
    """Run ``model`` and record the first call's arguments of the submodules at ``paths``."""
    seen: Dict[str, Tuple[tuple, dict]] = {}
    handles = []
    for path in paths:
        if not path:
            continue

        def hook(module, hook_args, hook_kwargs, path=path):
            seen.setdefault(path, (hook_args, hook_kwargs))

        handles.append(model.get_submodule(path).register_forward_pre_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    if "" in paths:
        seen[""] = (args, kwargs)
    return out, seen


class Recorder(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, wanted: Dict[str, Any]) -> None:
        super().__init__(gm)
        self.wanted, self.values = wanted, {}

    def run_node(self, node: fx.Node) -> Any:
        out = super().run_node(node)
        if node.name in self.wanted and isinstance(out, torch.Tensor):
            # A copy: a later in-place op (relu_, +=, ReLU(inplace=True)) would change the value seen.
            self.values[node.name] = out.detach().clone()
        return out


def run_recorded(recorder: fx.Interpreter, gm: fx.GraphModule, args: tuple, kwargs: dict) -> None:
    if has_pytree_codegen(gm):  # an exported graph: its placeholders take the flattened call
        recorder.run(*call_inputs(gm, args, kwargs), enable_io_processing=False)
    elif kwargs:  # a traced graph's placeholders are forward's parameters, in order
        bound = inspect.signature(gm.forward).bind(*args, **kwargs)
        bound.apply_defaults()
        recorder.run(*bound.arguments.values())
    else:
        recorder.run(*args)
