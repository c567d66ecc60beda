"""trace_model: symbolic tracing with leaf modules, and a record of what could not be traced.

Writes ``node.meta[MODULE_PATH]`` (the module whose forward produced each node). When a
submodule cannot be traced, it is retried as a leaf and reported in ``TraceResult.untraceable``
(the caller descends into it); when the root itself cannot be traced, ``graph_module`` is None.

A forward that writes one of its buffers or parameters in place (``self.running.mul_(0.9)``, a cache filled
per call) cannot be traced either, though torch.fx does not say so: it runs the write once, while tracing,
and records nothing, so the graph would read the value that write left on every call. Such a write is
found by the tensor's version counter; the buffers are put back as they were, and the module that owns
the tensor is untraceable (``capture="auto"`` then captures it with torch.export, which records the write).
"""

from __future__ import annotations

import itertools
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import fx, nn

from lucid_fx import _meta

__all__ = ["TraceResult", "TraceOptions", "Untraceable", "TraceFailure", "WritesStateInPlace", "trace_model", "TRACED_THROUGH",
           "buffer_values", "restore_buffers"]


@dataclass(frozen=True)
class Untraceable:
    """A module that symbolic tracing could not go through."""

    path: str  # qualified name; "" for the root
    type_name: str
    error: str
    source_line: str

    def describe(self) -> str:
        where = self.path or "<root>"
        return f"{where} ({self.type_name}) at {self.source_line}: {self.error}"


@dataclass(frozen=True)
class TraceOptions:
    """How a graph was traced, kept on it as ``gm.meta[TRACE]`` by prepare so that compare traces
    the float model into the same nodes with the same names."""

    leaf_modules: Tuple[Any, ...] = ()
    concrete_args: Optional[Dict[str, Any]] = None
    autowrap_functions: Tuple[Callable, ...] = ()
    capture: str = "fx"  # "export": the graph came from torch.export (passes/export_model.py)


class TraceFailure(ValueError):
    """Raised with ``strict=True`` when a module cannot be traced."""


class WritesStateInPlace(RuntimeError):
    """A forward wrote a buffer or parameter in place while torch.fx traced it (and recorded no such write)."""


def _versions(model: nn.Module) -> Dict[str, int]:
    return {name: t._version for name, t in itertools.chain(model.named_parameters(), model.named_buffers())}


def buffer_values(model: nn.Module) -> Dict[str, torch.Tensor]:
    """Every buffer's value by qualified name, copied."""
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


def restore_buffers(model: nn.Module, values: Dict[str, torch.Tensor]) -> None:
    """Put back ``values`` in the buffers of ``model`` of the same name, shape and dtype: after a trace that ran a
    write, and after prepare's own runs of the model (shapes, FLOPs, torch.export), so that calibration starts
    from the state of the model it came from."""
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            value = values.get(name)
            if value is not None and value.shape == buffer.shape and value.dtype == buffer.dtype and not torch.equal(value, buffer):
                buffer.copy_(value)


def _check_state(model: nn.Module, versions: Dict[str, int], saved: Dict[str, torch.Tensor], tracer: "_Tracer") -> None:
    """Raise :class:`WritesStateInPlace` (the buffers put back first) when tracing changed a version in ``versions``."""
    written = [name for name, version in _versions(model).items() if versions.get(name, version) != version]
    if not written:
        return
    restore_buffers(model, saved)
    buffers = dict(model.named_buffers())
    tracer.failed_path = written[0].rpartition(".")[0]
    kind = "buffer" if written[0] in buffers else "parameter"
    raise WritesStateInPlace(f"forward writes {kind} {written[0]!r} in place, which torch.fx runs once while tracing "
                             "instead of recording it (the graph would read that one value on every call)")


@dataclass
class TraceResult:
    graph_module: Optional[fx.GraphModule]
    untraceable: List[Untraceable] = field(default_factory=list)


# torch.nn modules that torch.fx keeps as leaves (it keeps every torch.nn module) but that are compositions of ops
# with rules: traced through like a user's module. Their forwards branch on the inputs (the fast paths), which
# torch.fx cannot trace, so prepare captures them with torch.export (capture="auto"), whose graph is their linears,
# attention and norms: an nn.TransformerEncoder of d 256 on 8 x 128 tokens ran 3.4x fp32 in int8, where as one
# float leaf it ran at fp32's speed (leaf_modules keeps one a leaf).
TRACED_THROUGH = (nn.Transformer, nn.TransformerEncoder, nn.TransformerEncoderLayer, nn.TransformerDecoder,
                  nn.TransformerDecoderLayer, nn.MultiheadAttention)


class _Tracer(fx.Tracer):
    def __init__(self, leaf_paths, leaf_types, autowrap_functions) -> None:
        super().__init__(autowrap_functions=tuple(autowrap_functions))
        self.leaf_paths = set(leaf_paths)
        self.leaf_types = tuple(leaf_types)
        self.path_stack: List[str] = []
        self.failed_path: Optional[str] = None

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if qualname in self.leaf_paths or (self.leaf_types and isinstance(m, self.leaf_types)):
            return True
        return not isinstance(m, TRACED_THROUGH) and super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        path = self.path_of_module(m)
        self.path_stack.append(path)
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_path is None:  # the innermost module sees the error first
                self.failed_path = path
            raise
        finally:
            self.path_stack.pop()

    def create_node(self, kind, target, args, kwargs, name=None, type_expr=None):
        node = super().create_node(kind, target, args, kwargs, name, type_expr)
        node.meta[_meta.MODULE_PATH] = target if kind == "call_module" else (self.path_stack[-1] if self.path_stack else "")
        return node


def _user_source_line(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        name = frame.filename.replace("\\", "/")
        if "/torch/" not in name and "/passes/trace_model.py" not in name:
            return f"{frame.filename}:{frame.lineno} `{(frame.line or '').strip()}`"
    return "<unknown source>"


def trace_model(
    model: nn.Module,
    *,
    leaf_modules: Sequence[Any] = (),
    concrete_args: Optional[Dict[str, Any]] = None,
    autowrap_functions: Sequence[Callable] = (),
    strict: bool = False,
    path_prefix: str = "",
) -> TraceResult:
    """Trace ``model`` with torch.fx; submodules that fail are retried as leaves and reported.

    ``leaf_modules`` holds qualified names and/or module classes to keep as single nodes.
    With ``strict=True`` the first untraceable module raises :class:`TraceFailure`, naming the
    module path, the source line and the option that fixes it.
    """
    if isinstance(model, fx.GraphModule):
        for node in model.graph.nodes:
            node.meta.setdefault(_meta.MODULE_PATH, node.target if node.op == "call_module" else "")
        return TraceResult(model)
    leaf_paths = {m for m in leaf_modules if isinstance(m, str)}
    leaf_types = [m for m in leaf_modules if isinstance(m, type)]
    found: List[Untraceable] = []
    while True:
        tracer = _Tracer(leaf_paths, leaf_types, autowrap_functions)
        versions, saved = _versions(model), buffer_values(model)
        try:
            graph = tracer.trace(model, concrete_args=concrete_args)
            _check_state(model, versions, saved, tracer)
        except Exception as exc:  # noqa: BLE001 - any tracing error means "keep this part float"
            path = tracer.failed_path or ""
            module = model.get_submodule(path) if path else model
            entry = Untraceable(
                path_prefix + ("." if path_prefix and path else "") + path,
                type(module).__name__,
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                _user_source_line(exc),
            )
            if strict:
                fix = (f"prepare with capture='export' (torch.export records the write), or pass leaf_modules=[{path!r}]"
                       if isinstance(exc, WritesStateInPlace) else
                       f"pass leaf_modules=[{path!r}] (keep it one float node), concrete_args={{...}} for optional "
                       "arguments, or strict=False to keep it float and quantize its traceable children")
                raise TraceFailure(f"cannot trace {entry.describe()}. Fix: {fix}") from exc
            found.append(entry)
            if not path or path in leaf_paths:
                return TraceResult(None, found)
            leaf_paths.add(path)
            continue
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        return TraceResult(gm, found)
