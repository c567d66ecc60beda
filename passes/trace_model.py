"""trace_model: symbolic tracing with leaf modules, and a record of what could not be traced.

Writes ``node.meta[MODULE_PATH]`` (the module whose forward produced each node). When a
submodule cannot be traced, it is retried as a leaf and reported in ``TraceResult.untraceable``
(the caller descends into it); when the root itself cannot be traced, ``graph_module`` is None.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from torch import fx, nn

from lucid_fx import _meta

__all__ = ["TraceResult", "TraceOptions", "Untraceable", "TraceFailure", "trace_model", "TRACED_THROUGH"]


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
        try:
            graph = tracer.trace(model, concrete_args=concrete_args)
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
                raise TraceFailure(
                    f"cannot trace {entry.describe()}. Fix: pass leaf_modules=[{path!r}] (keep it one float "
                    f"node), concrete_args={{...}} for optional arguments, or strict=False to keep it float and "
                    "quantize its traceable children"
                ) from exc
            found.append(entry)
            if not path or path in leaf_paths:
                return TraceResult(None, found)
            leaf_paths.add(path)
            continue
        gm = fx.GraphModule(tracer.root, graph, type(model).__name__)
        return TraceResult(gm, found)
