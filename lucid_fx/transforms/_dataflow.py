"""What a model computes on one input, recorded as it runs: every torch function call, the module
that made it, the values it read and the values it wrote.

The transforms use it to find layers that feed each other (a conv whose only reader is a batch
norm, then a ReLU, then another conv; a norm whose output only linears read). Recording the
run, not tracing the code, sees across module boundaries and through code torch.fx cannot trace
(the Llama-like decoder layer unpacks a tuple argument), and sees every reader of a value,
module or not, so a value read by anything unexpected is never rescaled.

A value is a tensor at one version, ``(id(tensor), tensor._version)``: an in-place op
(``relu_``, ``+=``) makes a new value of the same tensor. Every tensor seen is kept alive until
the recording is dropped, so no id is reused by another tensor meanwhile.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode, resolve_name
from torch.utils._pytree import tree_leaves

__all__ = ["Call", "Dataflow", "record", "call_model", "module_of", "layer_module", "LAYER_CALLS"]

Key = Tuple[int, int]  # (id(tensor), tensor._version): one value

# Calls that only look at a tensor's metadata: they read no value.
_METADATA = frozenset(
    f"torch.Tensor.{name}" for name in (
        "dim", "size", "shape.__get__", "ndim.__get__", "dtype.__get__", "device.__get__", "stride",
        "is_contiguous", "is_floating_point", "numel", "__len__", "layout.__get__", "requires_grad.__get__",
        "is_cuda.__get__", "element_size", "nelement", "data_ptr", "storage_offset", "is_complex", "_version.__get__",
    )
)


_F = "torch.nn.functional."
# The functional calls of the layers whose weights the transforms rescale, and their modules.
LAYER_CALLS = {_F + "conv1d": nn.Conv1d, _F + "conv2d": nn.Conv2d, _F + "conv3d": nn.Conv3d, _F + "linear": nn.Linear}


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` on one batch as ``lucid_fx.calibrate`` does: a tensor, a tuple/list of
    positional inputs, or a dict of keyword inputs."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def _key(t: torch.Tensor) -> Key:
    try:
        return (id(t), t._version)
    except RuntimeError:  # an inference-mode tensor has no version counter
        return (id(t), 0)


def _tensors(value: Any) -> List[torch.Tensor]:
    return [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]


@dataclass
class Call:
    """One torch function call: ``name`` as ``torch.overrides.resolve_name`` gives it
    (``torch.nn.functional.conv2d``, ``torch.Tensor.add``), its arguments, the values it read
    (every tensor argument, in order) and wrote, and the innermost module running it."""

    index: int
    name: str
    func: Callable
    args: tuple
    kwargs: dict
    reads: List[Key]
    writes: List[Key]
    module: str
    out: Any = None  # what it returned

    @property
    def alias(self) -> bool:
        """Returns its first input itself, unchanged (eval-mode dropout, ``contiguous`` on a
        contiguous tensor): a reader of its output reads the input."""
        return bool(self.reads) and self.writes == [self.reads[0]]


@dataclass
class Dataflow:
    calls: List[Call] = field(default_factory=list)
    outputs: Set[Key] = field(default_factory=set)
    names: Dict[int, str] = field(default_factory=dict)  # id(parameter or buffer) -> qualified name
    module_calls: Dict[str, int] = field(default_factory=collections.Counter)
    module_outputs: Dict[str, List[Key]] = field(default_factory=dict)  # a module's output values (last call)
    kept: List[torch.Tensor] = field(default_factory=list, repr=False)
    _readers: Dict[Key, List[Call]] = field(default_factory=lambda: collections.defaultdict(list), repr=False)

    def readers(self, key: Key) -> List[Call]:
        """The calls that read ``key``, metadata queries and aliases left out (an alias's output
        is the same value, so its readers are already ``key``'s readers)."""
        return [c for c in self._readers.get(key, []) if not c.alias and c.name not in _METADATA]

    def reaches_output(self, key: Key) -> bool:
        return key in self.outputs

    def tensor_readers(self, tensor: torch.Tensor) -> List[Call]:
        """The calls that read a parameter or buffer."""
        return self.readers(_key(tensor))


class _Recorder(TorchFunctionMode):
    def __init__(self, flow: Dataflow, stack: List[str]) -> None:
        super().__init__()
        self.flow, self.stack = flow, stack

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs))
        reads = [_key(t) for t in inputs]
        out = func(*args, **kwargs)
        outputs = _tensors(out)
        self.flow.kept += inputs + outputs
        name = resolve_name(func) or getattr(func, "__qualname__", repr(func))
        call = Call(len(self.flow.calls), name, func, args, kwargs, reads, [_key(t) for t in outputs], self.stack[-1], out)
        self.flow.calls.append(call)
        for key in dict.fromkeys(reads):
            self.flow._readers[key].append(call)
        return out


def record(model: nn.Module, batch: Any) -> Dataflow:
    """Run ``model`` once on ``batch`` (no grad) and record its dataflow."""
    flow = Dataflow()
    for name, tensor in list(model.named_parameters(remove_duplicate=False)) + list(model.named_buffers(remove_duplicate=False)):
        flow.names.setdefault(id(tensor), name)
    stack, handles = [""], []

    def enter(name):
        def hook(module, args):
            stack.append(name)
            flow.module_calls[name] += 1

        return hook

    def leave(name):
        def hook(module, args, output):
            stack.pop()
            flow.module_outputs[name] = [_key(t) for t in _tensors(output)]
            flow.kept.extend(_tensors(output))

        return hook

    for name, module in model.named_modules(remove_duplicate=False):
        if name:
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave(name), always_call=True))
    try:
        with torch.no_grad(), _Recorder(flow, stack):
            out = call_model(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    flow.outputs = {_key(t) for t in _tensors(out)}
    flow.kept += _tensors(out)
    return flow


def module_of(flow: Dataflow, model: nn.Module, tensor: Optional[torch.Tensor], types: tuple) -> Optional[str]:
    """The qualified name of the module of ``types`` whose parameter or buffer ``tensor`` is
    (``F.conv2d``'s weight -> the conv), or None."""
    if not isinstance(tensor, torch.Tensor) or id(tensor) not in flow.names:
        return None
    owner = flow.names[id(tensor)].rpartition(".")[0]
    try:
        module = model.get_submodule(owner)
    except AttributeError:
        return None
    return owner if isinstance(module, types) else None


def layer_module(flow: Dataflow, model: nn.Module, call: Call) -> Optional[str]:
    """The conv/linear module whose ``forward`` made ``call``, if the module ran once and its
    weight and bias were read by this call alone (so rescaling them changes nothing else)."""
    cls = LAYER_CALLS.get(call.name)
    weight = call.args[1] if len(call.args) > 1 else call.kwargs.get("weight")
    name = module_of(flow, model, weight, (cls,)) if cls else None
    if name is None or call.module != name or flow.module_calls[name] != 1:
        return None
    module = model.get_submodule(name)
    if type(module) is not cls or flow.tensor_readers(module.weight) != [call]:
        return None
    return name if module.bias is None or flow.tensor_readers(module.bias) == [call] else None
