"""prepare / prepare_qat: trace, then run the prepare pipeline (lucid_fx.pipeline.PREPARE_PASSES) on each graph.

    trace_model -> record_trace -> functionalize_inplace -> propagate_shapes -> canonicalize_ops -> fuse_patterns
                -> analyze_ranges -> choose_observers -> insert_observers

With ``capture="auto"`` (the default) a module whose forward torch.fx cannot trace is captured with
torch.export instead (lucid_fx/_capture.py); one that neither captures stays float, prepare descends
into it and quantizes the children that do capture, and ``prepared.lucid_fx_report`` says which
capture was used where.
"""

from __future__ import annotations

import contextlib
import gc
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch import nn

from lucid_fx._copy import copy_model
from lucid_fx._capture import ExportFailure, check_capture, check_dynamic_shapes, exported_graph, graph_inputs, is_exported, split_inputs
from lucid_fx._prepared_registry import remember_registry
from lucid_fx._fallback import Capture, keep_attributes, keyword_placeholders, part_arguments
from lucid_fx._validate import looks_like_inputs, model_device, require_float32, require_float_model, require_module, unwrap_compiled
from lucid_fx.kernels.target import resolve_target
from lucid_fx.passes.trace_model import TRACED_THROUGH, TraceOptions, Untraceable, buffer_values, restore_buffers, trace_model
from lucid_fx.pipeline import PREPARE_PASSES, PrepareContext, run_passes
from lucid_fx.quantization.qconfig import QConfigMapping, get_default_qat_qconfig_mapping, get_default_qconfig_mapping
from lucid_fx.registry import Registry, current_registry

__all__ = ["prepare", "prepare_qat", "PrepareReport"]


@dataclass
class PrepareReport:
    """What prepare did beyond the graph: how each graph was captured (module path -> ``"fx"``,
    ``"export"`` or ``"float (why)"``), and the modules left float because neither capture worked."""

    float_modules: List[Untraceable] = field(default_factory=list)
    backend: str = "cpu"
    qat: bool = False
    captures: Dict[str, str] = field(default_factory=dict)
    # module path -> matrix FLOPs of its calls, measured once in float where there is code that is not a graph
    module_flops: Dict[str, int] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = ["captured: " + ", ".join(f"{path or '<root>'} -> {how}" for path, how in self.captures.items())]
        if not self.float_modules:
            return "\n".join(lines + ["every module traced"])
        lines += ["kept float (could not be traced; their traceable children are quantized):"]
        lines += [f"  {u.describe()}" for u in self.float_modules]
        return "\n".join(lines)

    def exported(self, path: str) -> None:
        """``path`` was captured by torch.export: neither it nor its submodules stay float."""
        inside = lambda p: p == path or not path or p.startswith(path + ".")  # noqa: E731
        self.float_modules[:] = [u for u in self.float_modules if not inside(u.path)]
        self.captures = {p: how for p, how in self.captures.items() if not inside(p) or p == path}
        self.captures[path] = "export"


def _prepare_parts(owner: nn.Module, paths: Sequence[str], ctx: PrepareContext, capture: Capture, report: PrepareReport) -> None:
    """The recursion over what could not be traced: prepare each submodule of ``owner`` at
    ``paths`` (relative to it) as a graph of its own, with the call it received (keywords and
    defaults included: lucid_fx/_fallback.py)."""
    if not paths:
        return
    full = {path: f"{ctx.path}.{path}" if ctx.path else path for path in paths}
    captured = capture.calls(list(full.values()))
    for path in paths:
        child = owner.get_submodule(path)
        inputs, concrete = part_arguments(child, captured.get(full[path]))
        trace = replace(ctx.trace, concrete_args=concrete)
        part = replace(ctx, path=full[path], example_inputs=inputs, example_kwargs=None, trace=trace)
        owner.set_submodule(path, keep_attributes(child, _prepare_one(child, part, capture, report)))


def _prepare_exported(model: nn.Module, ctx: PrepareContext, report: PrepareReport) -> nn.Module:
    gm, part = exported_graph(model, ctx)
    part = replace(part, trace=replace(ctx.trace, capture="export"))  # compare captures the float model the same way
    report.exported(ctx.path)
    return run_passes(gm, part, PREPARE_PASSES)


def _prepare_one(model: nn.Module, ctx: PrepareContext, capture: Capture, report: PrepareReport) -> nn.Module:
    if ctx.capture == "export" or is_exported(model):
        return _prepare_exported(model, ctx, report)
    how = ctx.trace  # a nested part's: the concrete_args its parent's call implies
    result = trace_model(
        model,
        leaf_modules=how.leaf_modules,
        concrete_args=how.concrete_args,
        autowrap_functions=how.autowrap_functions,
        strict=ctx.strict,
        path_prefix=ctx.path,
    )
    known = {u.path for u in report.float_modules}
    report.float_modules.extend(u for u in result.untraceable if u.path not in known)
    gm = result.graph_module
    if gm is None and ctx.capture == "auto":
        try:
            return _prepare_exported(model, ctx, report)
        except ExportFailure as exc:
            report.captures[ctx.path] = f"float (torch.fx: {result.untraceable[-1].error}; {exc})"
    if gm is None:
        report.captures.setdefault(ctx.path, f"float (torch.fx: {result.untraceable[-1].error})")
        if isinstance(model, TRACED_THROUGH):  # torch's attention calls no child as a module: one float leaf
            return model
        # The module's own forward cannot be traced: keep it as Python glue, one level down.
        children = [name for name, _ in model.named_children()]
        capture.calls([f"{ctx.path}.{name}" if ctx.path else name for name in children])
        # parameter-free leaves (activations) gain nothing alone
        kept = [name for name in children if any(True for _ in model.get_submodule(name).parameters())
                or list(model.get_submodule(name).children())]
        _prepare_parts(model, kept, ctx, capture, report)
        return model
    report.captures[ctx.path] = "fx"
    # Untraceable submodules became leaves: descend into each.
    prefix = ctx.path
    leaves = [f"{prefix}.{n.target}" if prefix else n.target for n in gm.graph.nodes if n.op == "call_module"
              and ctx.registry.spelling_for("call_module", gm.get_submodule(n.target)) is None]
    if leaves and not ctx.qat:  # a training-mode run would move batch-norm statistics
        capture.calls(leaves)  # runs the float model once: the FLOPs inside opaque leaves, for the convert report
    inner = [u.path[len(prefix) + 1 :] if prefix else u.path for u in result.untraceable if u.path and u.path != prefix]
    _prepare_parts(gm, inner, ctx, capture, report)
    if how.concrete_args:
        gm = keyword_placeholders(gm, model)
    ctx = replace(ctx, example_inputs=graph_inputs("prepare", gm, ctx.example_inputs, ctx.example_kwargs), example_kwargs=None)
    try:
        return run_passes(gm, ctx, PREPARE_PASSES)
    except (ValueError, TypeError, RuntimeError) as exc:
        raise _in_part(exc, ctx.path, model) from exc


def _in_part(exc: Exception, path: str, model: nn.Module) -> Exception:
    """``exc`` naming the submodule it came from: a nested part's passes know only its own nodes."""
    if not path:
        return exc
    try:
        return type(exc)(f"prepare: in submodule {path!r} ({type(model).__name__}), prepared as a graph of its own: {exc}")
    except Exception:  # noqa: BLE001 - an exception type with another constructor: keep it as it is
        return exc


@contextlib.contextmanager
def _gc_paused():
    """Prepare allocates many small objects (nodes, observers); the cyclic collector's full
    passes over them made prepare time grow faster than the model. Measured on MLPs of 200, 400
    and 800 layers, insert_observers took 56, 96, 260 ms with it on and 50, 97, 196 ms paused."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _context(model, qat, qconfig_mapping, example_inputs, backend, registry, leaf_modules, concrete_args, strict,
             capture="fx", example_kwargs=None, dynamic_shapes=None) -> PrepareContext:
    """Check the user's arguments against ``model`` and gather them into the pipeline's context."""
    verb = "prepare_qat" if qat else "prepare"
    require_module(verb, model)
    require_float_model(verb, model)
    if backend is None:
        device = model_device(model)
        backend = "cuda" if device is not None and device.type == "cuda" else "cpu"
    target = resolve_target(backend)
    if qat and not model.training:
        raise ValueError("prepare_qat: the model is in eval mode; call model.train() first (or use prepare for post-training quantization)")
    # ep.module() marks itself training and refuses .eval(); export_model checks its graph's ops instead
    training = None if is_exported(model) else next((name or type(model).__name__ for name, m in model.named_modules() if m.training), None)
    if not qat and training is not None:
        raise ValueError(
            f"prepare: the model is in training mode; call model.eval() first (module {training!r} has "
            "training=True; batch norm and dropout must be frozen for post-training quantization), or use "
            "prepare_qat to train with fake quantization"
        )
    if looks_like_inputs(qconfig_mapping) and (example_inputs is None or isinstance(example_inputs, QConfigMapping)):
        warnings.warn(
            f"{verb}: took the {type(qconfig_mapping).__name__} given second as example_inputs. {verb}'s positional "
            f"order is torch.ao's, {verb}(model, qconfig_mapping, example_inputs); pass them by keyword, "
            f"{verb}(model, example_inputs=..., qconfig_mapping=...), to silence this",
            stacklevel=3,
        )
        qconfig_mapping, example_inputs = example_inputs, qconfig_mapping
    example_inputs, example_kwargs = split_inputs(example_inputs, example_kwargs)
    require_float32(verb, model, tuple(example_inputs or ()) + tuple((example_kwargs or {}).values()))
    if qconfig_mapping is None:
        qconfig_mapping = get_default_qat_qconfig_mapping() if qat else get_default_qconfig_mapping()
    if not isinstance(qconfig_mapping, QConfigMapping):
        raise TypeError(f"qconfig_mapping must be a QConfigMapping, got {type(qconfig_mapping).__name__}")
    registry = registry or current_registry()
    trace = TraceOptions(tuple(leaf_modules) + tuple(registry.leaf_modules), concrete_args, tuple(registry.leaf_functions))
    capture = check_capture(verb, capture)
    return PrepareContext(registry, qconfig_mapping, target, qat, example_inputs, trace, strict, "", capture, example_kwargs,
                          check_dynamic_shapes(verb, dynamic_shapes, model))


def _prepare(model: nn.Module, inplace: bool, ctx: PrepareContext) -> nn.Module:
    work = model if inplace else copy_model(model)
    report, state = PrepareReport(backend=ctx.target.backend, qat=ctx.qat), buffer_values(work)
    with _gc_paused():
        capture = Capture(work, ctx.example_inputs, ctx.example_kwargs)
        prepared = _prepare_one(work, ctx, capture, report)
    restore_buffers(prepared, state)  # as the model was: prepare's runs of it leave no state behind
    report.module_flops = capture.flops
    prepared.lucid_fx_report = report
    remember_registry(prepared, ctx.registry)  # convert and explain use its rules without being told again
    if ctx.qat:
        prepared.train()
    return prepared


def prepare(
    model: nn.Module,
    qconfig_mapping: Optional[QConfigMapping] = None,
    example_inputs: Optional[tuple] = None,
    *,
    backend: Optional[str] = None,
    inplace: bool = False,
    registry: Optional[Registry] = None,
    leaf_modules: Sequence[Any] = (),
    concrete_args: Optional[Dict[str, Any]] = None,
    strict: bool = False,
    capture: str = "auto",
    example_kwargs: Optional[Dict[str, Any]] = None,
    dynamic_shapes: Any = None,
) -> nn.Module:
    """Trace ``model`` and insert observers: FixedQParamsObserver on every output whose range is
    proven bounded, the QConfig's observers everywhere else a quantized kernel will run.

    Args:
        model: an eval-mode ``nn.Module``, an already traced ``fx.GraphModule``, or a
            ``torch.export.ExportedProgram`` (or its ``.module()``) exported in eval mode.
        qconfig_mapping: which QConfig where (default: :func:`get_default_qconfig_mapping`).
        example_inputs: positional inputs of ``forward``; they give shapes and dtypes
            (integer inputs such as token ids stay unquantized). A dict: keyword inputs.
        backend: ``"cpu"`` (default) or ``"cuda"``.
        inplace: modify ``model`` instead of a copy.
        registry: rule tables to use (default: the current registry).
        leaf_modules: qualified names or classes to keep as single float nodes.
        concrete_args: passed to torch.fx to specialise optional arguments.
        strict: raise on an untraceable module instead of keeping it float.
        capture: ``"auto"`` (torch.fx, and torch.export for a module fx cannot trace), ``"fx"``
            or ``"export"`` (see docs/prepare.md); ``prepared.lucid_fx_report.captures`` says
            which was used where.
        example_kwargs: keyword inputs of ``forward`` (``model(**encoding)``).
        dynamic_shapes: where prepare captures the model with torch.export, which fixes its shapes:
            ``"auto"`` (each dim dynamic unless the model fixes it) or torch.export's own dict by
            parameter name (``{"input_ids": {0: Dim("batch"), 1: Dim("seq")}}``).

    Returns:
        The observed model, a ``GraphModule`` (or, if the top level itself cannot be traced,
        the model with its traceable children prepared). It computes exactly what the float
        model computes; ``explain(prepared)`` says which rule chose each observer.

    Example:
        >>> import torch, lucid_fx
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Sigmoid()).eval()
        >>> prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(2, 4),))
        >>> sorted(prepared.lucid_fx_observers.keys())
        ['_0', '_1', 'input_1']
        >>> type(prepared.lucid_fx_observers["_1"]).__name__
        'FixedQParamsObserver'
    """
    model = unwrap_compiled("prepare", model)
    if isinstance(model, torch.export.ExportedProgram):
        if example_inputs is None and example_kwargs is None and model.example_inputs is not None:
            example_inputs, example_kwargs = model.example_inputs
        model, inplace = model.module(), True  # a fresh module: the program itself is not changed
    ctx = _context(model, False, qconfig_mapping, example_inputs, backend, registry, leaf_modules, concrete_args, strict,
                   capture, example_kwargs, dynamic_shapes)
    return _prepare(model, inplace, ctx)


def prepare_qat(
    model: nn.Module,
    qconfig_mapping: Optional[QConfigMapping] = None,
    example_inputs: Optional[tuple] = None,
    *,
    backend: Optional[str] = None,
    inplace: bool = False,
    registry: Optional[Registry] = None,
    leaf_modules: Sequence[Any] = (),
    concrete_args: Optional[Dict[str, Any]] = None,
    strict: bool = False,
) -> nn.Module:
    """Like :func:`prepare` for quantization-aware training: FakeQuantize modules (and
    FixedQParamsFakeQuantize on range-bounded outputs), and fake-quantized weights, on a
    training-mode model."""
    model = unwrap_compiled("prepare_qat", model)
    ctx = _context(model, True, qconfig_mapping, example_inputs, backend, registry, leaf_modules, concrete_args, strict)
    return _prepare(model, inplace, ctx)
