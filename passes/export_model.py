"""export_model: capture a model with torch.export and give back a GraphModule that the prepare
pipeline reads as it reads a torch.fx trace.

``torch.export.export(model, args, kwargs, strict=False)`` (or the user's ``ExportedProgram``),
then ``ep.module()``: parameters and buffers become get_attr nodes on a module tree that keeps
their qualified names (so the linear/conv rules find weights as they do for ``F.linear`` on
get_attr); the graph keeps the export's pytree codegen, so the result is called with the model's
own positional and keyword arguments. Then: the training flags ``ep.module()`` sets are cleared
(the graph already holds the eval-mode ops), the input guard is removed, the no-op higher-order
wraps (``set_grad_enabled``, disabled autocast) are inlined, aten calls are rewritten by
passes/rewrite_aten.py, and functional layers on their own parameters become module calls again
(passes/restore_modules.py).

Writes ``node.meta[MODULE_PATH]`` from the export's ``nn_module_stack``.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import operator
import warnings
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import fx, nn

from lucid_fx import _meta
from lucid_fx.passes.restore_modules import restore_modules
from lucid_fx.passes.rewrite_aten import rewrite_aten

__all__ = ["export_model", "ExportFailure", "flat_inputs", "call_inputs", "placeholders_first"]


class ExportFailure(ValueError):
    """torch.export could not capture a module; the message names it."""


@dataclass(frozen=True)
class _Wrap:
    submodule_at: int  # where the subgraph's get_attr is among the HOP's arguments
    inline: Any  # (args) -> bool: may the wrap be dropped and its body inlined?


_HOP = getattr(torch.ops, "higher_order", None)
# Wraps that change nothing a float32 inference graph computes, by higher-order op name.
_WRAPS: Dict[str, _Wrap] = {
    "wrap_with_set_grad_enabled": _Wrap(1, lambda args: True),  # (enabled, body, *xs): no autograd here
    "wrap_with_autocast": _Wrap(4, lambda args: args[2] is False),  # (device, dtype, enabled, cache, body, *xs)
}


def _inline_wraps(gm: fx.GraphModule) -> None:
    changed = True
    while changed:
        changed = False
        for node in list(gm.graph.nodes):
            wrap = _WRAPS.get(getattr(node.target, "__name__", "")) if node.op == "call_function" else None
            if wrap is None or not wrap.inline(node.args):
                continue
            body = getattr(gm, node.args[wrap.submodule_at].target)
            operands = node.args[wrap.submodule_at + 1:]
            placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
            env = dict(zip(placeholders, operands))
            with gm.graph.inserting_before(node):
                for inner in body.graph.nodes:
                    if inner.op == "placeholder":
                        continue
                    if inner.op == "output":
                        results = inner.args[0]
                        break
                    if inner.op == "get_attr":  # a nested wrap's body: move it up
                        name = f"{node.name}_{inner.target}"
                        gm.add_submodule(name, getattr(body, inner.target))
                        env[inner] = gm.graph.get_attr(name)
                        continue
                    env[inner] = gm.graph.node_copy(inner, lambda n: env[n])
                    env[inner].meta = {**node.meta, **inner.meta}
            for user in list(node.users):
                assert user.target is operator.getitem
                user.replace_all_uses_with(env[results[user.args[1]]])
                gm.graph.erase_node(user)
            gm.graph.erase_node(node)
            changed = True
    gm.graph.eliminate_dead_code()
    gm.delete_all_unused_submodules()


def _module_paths(gm: fx.GraphModule) -> None:
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack") or {}
        path = next(reversed(stack.values()))[0] if stack else ""
        if node.op == "get_attr":
            path = node.target.rpartition(".")[0]
        node.meta[_meta.MODULE_PATH] = path if isinstance(path, str) else ""


def _require_eval(gm: fx.GraphModule, path: str) -> None:
    for node in gm.graph.nodes:
        training = {F.dropout: 2, F.batch_norm: 5}.get(node.target) if node.op == "call_function" else None
        if training is not None and len(node.args) > training and node.args[training] is True:
            raise ValueError(
                f"prepare: {path or '<root>'} was exported in training mode (node {node.name!r} is {node.target.__name__} "
                "with training=True); call model.eval() before torch.export.export"
            )


def placeholders_first(graph: fx.Graph) -> None:
    """Move the placeholders before every other node, in their order, as torch.fx writes them
    (export puts the parameters' get_attr nodes first; the saved format expects placeholders)."""
    for node in reversed([n for n in graph.nodes if n.op == "placeholder"]):
        first = next(iter(graph.nodes))
        if first is not node:
            first.prepend(node)


def flat_inputs(gm: fx.GraphModule, args: tuple, kwargs: Optional[Dict[str, Any]]) -> tuple:
    """The graph's placeholder values for a call ``gm(*args, **kwargs)`` (the export's input spec)."""
    codegen = gm.graph._codegen
    info = getattr(codegen, "pytree_info", None)
    if info is None:
        return tuple(args)
    flat = torch.fx._pytree.tree_flatten_spec((tuple(args), dict(kwargs or {})), info.in_spec)
    return tuple(flat)


def call_inputs(gm: fx.GraphModule, args: tuple, kwargs: Dict[str, Any]) -> tuple:
    """The placeholder values of ``gm(*args, **kwargs)`` as the exported graph's own ``forward``
    binds them (by position or by name), for running the graph under an Interpreter."""
    info = getattr(gm.graph._codegen, "pytree_info", None)
    if info is None:
        return tuple(args)
    if hasattr(gm.graph._codegen, "flat_call"):  # forward with the model's signature (lucid_fx/_forward_signature.py)
        return tuple(gm.graph._codegen.flat_call(args, kwargs))
    bound = inspect.signature(gm.forward).bind(*args, **kwargs)
    values = list(bound.arguments.values())
    child = (lambda i: info.in_spec.child(i)) if hasattr(info.in_spec, "child") else (lambda i: info.in_spec.children_specs[i])
    positional, names = child(0).num_children, child(1).context  # (args, kwargs), as export writes a call
    return tuple(torch.fx._pytree.tree_flatten_spec((values[:positional], dict(zip(names, values[positional:]))), info.in_spec))


#: torch's loggers that print while torch.export tries a model: a failure on a data-dependent branch logged a warning
#: and printed the partial graph to stderr (27 lines, twice under capture="auto"), which ExportFailure's line says
#: instead.
TORCH_LOGS = ("torch.fx.experimental.symbolic_shapes", "torch._dynamo", "torch.export", "torch._export")


@contextlib.contextmanager
def _quiet(names: Tuple[str, ...]):
    """torch's loggers ``names`` silenced and what torch prints to stderr dropped (torch.export prints a failed
    capture's partial graph there, torch/export/_trace.py), then both as they were."""
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


def export_model(model: Any, args: tuple = (), kwargs: Optional[Dict[str, Any]] = None, *, path: str = "",
                 dynamic_shapes: Any = None) -> fx.GraphModule:
    """``model`` (an ``nn.Module``, an ``ExportedProgram`` or its ``.module()``) as a GraphModule of
    torch-level calls, captured by torch.export on ``args``/``kwargs``.

    Raises :class:`ExportFailure` naming ``path`` (the module's place in the root model) when
    torch.export fails.
    """
    if isinstance(model, torch.export.ExportedProgram):
        gm = model.module()
    elif isinstance(model, fx.GraphModule) and isinstance(getattr(model.graph, "_codegen", None), torch.fx.graph._PyTreeCodeGen):
        gm = model  # already an ep.module() (prepare works on its own copy)
    else:
        if not isinstance(model, nn.Module):
            raise TypeError(f"export_model: expected an nn.Module or ExportedProgram, got {type(model).__name__}")
        try:
            with warnings.catch_warnings(), _quiet(TORCH_LOGS):  # nn.LSTM's forward sets its _flat_weights list, which export reports
                warnings.filterwarnings("ignore", message=r"The tensor attributes .*_flat_weights\[", category=UserWarning)
                ep = torch.export.export(model, tuple(args), dict(kwargs or {}), strict=False, dynamic_shapes=dynamic_shapes)
        except Exception as exc:  # noqa: BLE001 - reported with the module's name
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ExportFailure(
                f"torch.export cannot capture {path or '<root>'} ({type(model).__name__}): {type(exc).__name__}: {first}"
            ) from exc
        gm = ep.module()
    for name in ("train", "eval"):
        gm.__dict__.pop(name, None)  # ep.module() replaces both with methods that raise
    gm._forward_pre_hooks.clear()  # export's check that a call has the example's structure: prepare checks inputs itself
    # and the hook that undid one of those pre-hooks' effects (module-typed inputs) after each call: with
    # it the prepared model could not be saved ("hooks are code"), while the converted one could
    for hooks in (gm._forward_pre_hooks_with_kwargs, gm._forward_hooks, gm._forward_hooks_always_called):
        hooks.clear()  # the bookkeeping of those hooks too
    for name in ("range_constraints", "validate_inputs"):  # read only by those hooks (torch/export/_unlift.py)
        gm.__dict__.pop(name, None)
    gm.eval()  # ep.module() says train; its graph holds the ops of the mode it was exported in
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and node.target == "_guards_fn" and not node.users:
            gm.graph.erase_node(node)  # the export's input-shape guard: its shapes are in the graph anyway
    _inline_wraps(gm)
    _module_paths(gm)
    placeholders_first(gm.graph)
    rewrite_aten(gm)
    _require_eval(gm, path)
    restore_modules(gm)
    gm.delete_all_unused_submodules()
    gm.recompile()
    return gm
