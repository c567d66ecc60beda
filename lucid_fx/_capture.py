"""How prepare captures a graph: torch.fx (symbolic tracing), torch.export, or ``"auto"``: fx
first, and torch.export for a module whose own forward fx cannot trace (transformers' top levels:
keyword defaults, ``kwargs[...] = ...``, control flow on shapes).

Both captures give a GraphModule of torch-level calls (passes/export_model.py rewrites aten ops by
lucid_fx/rules/aten_ops.py), so the same prepare passes run on either.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from typing import Any, Dict, Optional, Tuple

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from lucid_fx._forward_signature import guard_inputs, mirror_signature
from lucid_fx.passes.export_model import ExportFailure, export_model, flat_inputs
from lucid_fx.pipeline import PrepareContext

__all__ = ["CAPTURES", "check_capture", "check_dynamic_shapes", "is_exported", "exported_graph", "export_like_prepare",
           "ExportFailure", "split_inputs", "graph_inputs"]

#: The values of ``prepare(..., capture=)``.
CAPTURES = ("auto", "fx", "export")


def check_capture(verb: str, capture: Any) -> str:
    if capture not in CAPTURES:
        raise ValueError(f"{verb}: capture={capture!r}; use one of {', '.join(map(repr, CAPTURES))}")
    return capture


def check_dynamic_shapes(verb: str, dynamic_shapes: Any, model: Any) -> Any:
    if dynamic_shapes is None or (dynamic_shapes == "auto" and not is_exported(model)):
        return dynamic_shapes
    if is_exported(model):
        raise ValueError(f"{verb}: dynamic_shapes is for a model prepare exports; an ExportedProgram has the shapes it "
                         "was exported with: export it with dynamic_shapes=... instead")
    if not isinstance(dynamic_shapes, dict):
        raise TypeError(f"{verb}: dynamic_shapes={dynamic_shapes!r:.80}; pass \"auto\" or a dict by forward's parameter "
                        "names, as torch.export.export takes it ({'input_ids': {0: Dim('batch'), 1: Dim('seq')}})")
    return dynamic_shapes


def _dynamic(spec: Any, kwargs: Dict[str, Any]) -> Any:
    """torch.export's dynamic_shapes for a call with ``kwargs``: ``"auto"`` marks every dim of every
    tensor input ``Dim.AUTO``."""
    if spec != "auto":
        return spec
    auto = lambda v: {d: torch.export.Dim.AUTO for d in range(v.dim())} if isinstance(v, torch.Tensor) else None  # noqa: E731
    return {name: pytree.tree_map(auto, value) for name, value in kwargs.items()}


def is_exported(model: Any) -> bool:
    """An ``ExportedProgram``, or the GraphModule its ``.module()`` returns."""
    if isinstance(model, torch.export.ExportedProgram):
        return True
    return isinstance(model, fx.GraphModule) and isinstance(getattr(model.graph, "_codegen", None), torch.fx.graph._PyTreeCodeGen)


def split_inputs(example_inputs: Any, example_kwargs: Optional[Dict[str, Any]]) -> Tuple[Optional[tuple], Optional[Dict[str, Any]]]:
    """(positional, keyword) example inputs: a dict given as ``example_inputs`` holds keywords."""
    if isinstance(example_inputs, dict):
        if example_kwargs:
            raise ValueError("prepare: example_inputs is a dict (keyword inputs) and example_kwargs is given too; pass one")
        return (), dict(example_inputs)
    if example_inputs is not None and not isinstance(example_inputs, tuple):
        example_inputs = (example_inputs,)
    if example_kwargs is not None and not isinstance(example_kwargs, dict):
        raise TypeError(f"prepare: example_kwargs must be a dict of forward's keyword inputs, got {type(example_kwargs).__name__}")
    return example_inputs, (dict(example_kwargs) if example_kwargs else None)


def graph_inputs(verb: str, gm: fx.GraphModule, args: Optional[tuple], kwargs: Optional[Dict[str, Any]]) -> Optional[tuple]:
    """The example inputs as ``gm``'s placeholders take them, in order: ``args`` first, then each keyword input by
    its placeholder's name (forward's parameter), a default where neither gives one. A traced graph's passes
    run it on these (passes/propagate_shapes.py); ``args`` as they are where there are no keywords or ``gm``
    takes ``*args`` or ``**kwargs``."""
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if not kwargs or any(str(n.target).startswith("*") for n in holders):
        return args
    args, names = tuple(args or ()), [str(n.target) for n in holders]
    unknown = [name for name in kwargs if name not in names[len(args):]]
    if unknown:
        twice = [name for name in unknown if name in names[:len(args)]]
        raise TypeError(f"{verb}: {type(gm).__name__}.forward({', '.join(names)}) "
                        + (f"got {twice[0]!r} by position and by name" if twice else
                           f"has no parameter {unknown[0]!r} (keyword inputs: {', '.join(kwargs)})"))
    filled = list(args)
    for node in holders[len(args):]:
        if str(node.target) in kwargs:
            filled.append(kwargs[str(node.target)])
        elif node.args:  # its default
            filled.append(node.args[0])
        else:
            raise TypeError(f"{verb}: {type(gm).__name__}.forward({', '.join(names)}) needs {node.target!r}, which "
                            f"the example inputs do not give (keyword inputs: {', '.join(kwargs)})")
    return tuple(filled)


def _by_name(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> Tuple[tuple, Dict[str, Any]]:
    """The inputs as keywords, those at their default left out: the exported module's forward then
    takes them by position or by name (torch.export fixes the call structure it saw)."""
    try:
        signature = inspect.signature(model.forward)
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError):
        return args, kwargs
    params = signature.parameters
    if any(p.kind in (p.VAR_POSITIONAL, p.POSITIONAL_ONLY) for p in params.values()):
        return args, kwargs
    named = {}
    for name, value in bound.arguments.items():
        if params[name].kind is params[name].VAR_KEYWORD:
            named.update(value)
        elif value is not params[name].default:
            named[name] = value
    return (), named


def export_like_prepare(model: nn.Module, args: tuple, kwargs: Dict[str, Any]) -> fx.GraphModule:
    """``model`` exported as prepare exports it (inputs by name), for compare's float graph."""
    return _export_by_name(model, tuple(args), dict(kwargs))[0]


def _export_by_name(model: nn.Module, args: tuple, kwargs: Dict[str, Any], path: str = "",
                    dynamic_shapes: Any = None) -> Tuple[fx.GraphModule, tuple, Dict[str, Any]]:
    """``model`` exported with its inputs by name, its forward called as ``model``'s is
    (lucid_fx/_forward_signature.py); and the inputs as captured."""
    args, kwargs = _by_name(model, args, kwargs)
    named = kwargs
    if dynamic_shapes == "auto" and args:  # forward(*args) or positional-only: by the parameter each binds to
        named = inspect.signature(model.forward).bind(*args, **kwargs).arguments
    gm = export_model(model, args, kwargs, path=path, dynamic_shapes=_dynamic(dynamic_shapes, named))
    mirror_signature(model, gm, None if args else kwargs)
    return gm, args, kwargs


def exported_graph(model: nn.Module, ctx: PrepareContext) -> Tuple[fx.GraphModule, PrepareContext]:
    """``model`` captured by torch.export on the context's example inputs, and the context for its
    graph (whose placeholders take the flattened inputs). Raises :class:`ExportFailure` naming
    ``ctx.path`` when torch.export cannot capture it."""
    args, kwargs = ctx.example_inputs, ctx.example_kwargs
    if args is None and not kwargs and not is_exported(model):
        raise ExportFailure(
            f"cannot capture {ctx.path or '<root>'} ({type(model).__name__}) with torch.export: no example inputs "
            "reached it; pass example_inputs (and example_kwargs) to prepare"
        )
    if is_exported(model):
        gm = export_model(model, args or (), kwargs, path=ctx.path)
        guard_inputs(gm)  # the checks ExportedProgram.module()'s hooks made, which prepare's graph does not keep
    else:
        # "auto" marks every dim of what a part received dynamic, as the root's; a dict names the root's inputs
        dynamic = ctx.dynamic_shapes if not ctx.path or ctx.dynamic_shapes == "auto" else None
        gm, args, kwargs = _export_by_name(model, tuple(args or ()), dict(kwargs or {}), ctx.path, dynamic)
    flat = flat_inputs(gm, args or (), kwargs) if (args is not None or kwargs) else None
    return gm, replace(ctx, example_inputs=flat, example_kwargs=None)
