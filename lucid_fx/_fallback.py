"""The fallback for modules torch.fx cannot trace: what prepare needs to prepare their children as
graphs of their own, where the parent stays Python glue.

- :class:`Capture`: the arguments, positional and keyword, each submodule received when the whole
  float model ran once on the example inputs (``self.self_attn(hidden_states=h, attention_mask=m)``
  is a keyword call; a record of positional arguments alone would see none).
- :func:`part_arguments`: a child's example inputs for its own trace and the ``concrete_args``
  (its ``forward``'s defaults the parent left out, and the constants it passed, such as
  ``output_attentions=False`` or ``past_key_value=None``) that let the child trace: what
  ``concrete_args`` does at the top level, applied below it. torch.fx guards each one, so a later
  call with another value fails with the parameter's name instead of computing something else.
- :func:`keyword_placeholders`: torch.fx renames the placeholder of a concrete argument
  (``attention_mask`` -> ``attention_mask_1``); the parent calls the child by keyword, so the
  graph's ``forward`` must keep the parameter names.
- :func:`keep_attributes`: a parent may read a plain attribute of a child that prepare (and later
  convert) replaced with a GraphModule (``self.conv1.stride``); the replacement keeps them.
"""

from __future__ import annotations

import inspect
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from lucid_fx._flops import counting_module_flops
from lucid_fx._meta import ATTRIBUTES

__all__ = ["Capture", "part_arguments", "keyword_placeholders", "keep_attributes", "restore_attributes"]

Call = Tuple[tuple, Dict[str, Any]]  # (positional args, keyword args) of one call
_CONSTANTS = (type(None), bool, int, float, str)  # values a child's trace may take as given


class Capture:
    """The call each module (by path from the root) received when the whole float model ran on the
    user's example inputs, so nested parts get shapes too.

    The model runs once, the first time this is needed: before prepare has changed anything, so
    no observer sees the example inputs."""

    def __init__(self, root: nn.Module, root_inputs: Optional[tuple], root_kwargs: Optional[dict] = None) -> None:
        self.root, self.root_inputs, self.root_kwargs, self.seen = root, root_inputs, root_kwargs or {}, None
        self.flops: Dict[str, int] = {}  # module path -> FLOPs of its calls in that run (the report's float share)

    def calls(self, paths: Sequence[str]) -> Dict[str, Call]:
        if self.root_inputs is None and not self.root_kwargs:
            return {}
        if self.seen is None:
            seen: Dict[str, Call] = {}
            hooks = []
            for path, module in self.root.named_modules():
                if path:
                    record = lambda mod, args, kwargs, _p=path: seen.setdefault(_p, (tuple(args), dict(kwargs)))  # noqa: E731
                    hooks.append(module.register_forward_pre_hook(record, with_kwargs=True))
            try:
                with torch.no_grad(), counting_module_flops(self.root) as self.flops:
                    self.root(*(self.root_inputs or ()), **self.root_kwargs)
            finally:
                for h in hooks:
                    h.remove()
            self.seen = seen
        return {path: self.seen[path] for path in paths if path in self.seen}


def _parameters(module: nn.Module):
    try:
        return list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a builtin forward: no signature to read
        return None


def part_arguments(module: nn.Module, call: Optional[Call]) -> Tuple[Optional[tuple], Optional[Dict[str, Any]]]:
    """(example inputs, concrete_args) for tracing ``module`` as a graph of its own, from the call
    it received in the root's run: the arguments in ``forward``'s order, the parameters it was not
    given at their defaults; constants given (None, bools, numbers, strings) and defaults not
    overridden become concrete. (None, None) when the call did not run; positional inputs and no
    concrete arguments when the signature cannot be read or takes ``*args``/``**kwargs``."""
    if call is None:
        return None, None
    args, kwargs = call
    params = _parameters(module)
    plain = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    if params is None or any(p.kind not in plain for p in params) or len(args) > len(params):
        return tuple(args), None
    values: Dict[str, Any] = dict(zip((p.name for p in params), args))
    values.update(kwargs)
    if set(values) - {p.name for p in params}:
        return tuple(args), None
    concrete: Dict[str, Any] = {}
    for p in params:
        if p.name not in values and p.default is not inspect.Parameter.empty:
            concrete[p.name] = p.default
        elif p.name in values and type(values[p.name]) in _CONSTANTS:
            concrete[p.name] = values[p.name]
    given = [i for i, p in enumerate(params) if p.name in values]
    inputs = tuple(values.get(p.name, p.default) for p in params[: max(given) + 1]) if given else ()
    return inputs, concrete or None


def keyword_placeholders(gm: fx.GraphModule, module: nn.Module) -> fx.GraphModule:
    """Give ``gm``'s placeholders the names of ``module.forward``'s parameters again (torch.fx
    renamed those of concrete arguments), so keyword calls reach them."""
    params = _parameters(module)
    holders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if params is None or len(params) != len(holders):
        return gm
    renamed = False
    for node, p in zip(holders, params):
        if node.target != p.name and node.target.rstrip("_0123456789") == p.name:
            node.target, renamed = p.name, True
    if renamed:
        gm.recompile()
    return gm


def keep_attributes(old: nn.Module, new: nn.Module) -> nn.Module:
    """Copy ``old``'s plain attributes (``stride``, ``num_channels``, a config object) that ``new``
    lacks onto ``new``; returns ``new``. A GraphModule also keeps them in ``meta[ATTRIBUTES]``: its
    deep copy (convert makes one) keeps only modules, parameters, buffers and ``meta``, and
    :func:`restore_attributes` sets them again."""
    found = {n: v for n, v in vars(old).items() if not n.startswith("_") and n != "training" and not isinstance(v, (nn.Module, torch.Tensor))}
    if isinstance(old, fx.GraphModule):
        found.update(old.meta.get(ATTRIBUTES, {}))
    kept = {name: value for name, value in found.items() if not hasattr(new, name)}
    for name, value in kept.items():
        setattr(new, name, value)
    if kept and isinstance(new, fx.GraphModule):
        new.meta[ATTRIBUTES] = {**new.meta.get(ATTRIBUTES, {}), **kept}
    return new


def restore_attributes(model: nn.Module) -> nn.Module:
    """Set again the attributes :func:`keep_attributes` gave the GraphModules in ``model`` (after a deep copy)."""
    for module in model.modules():
        if isinstance(module, fx.GraphModule):
            for name, value in module.meta.get(ATTRIBUTES, {}).items():
                if not hasattr(module, name):
                    setattr(module, name, value)
    return model
