"""convert: calibrated graphs become int8 kernels (or their simulated reference), through the convert
pipeline (lucid_fx.pipeline.CONVERT_PASSES) on each graph (``lucid_fx.quantize``, all three verbs
in one call, is lucid_fx/one_call.py).

    fold_batchnorm -> lower (lower_to_int8; insert_qdq if reference=True) -> fold_dequantize -> lower_recurrent
    -> record_activation_qparams -> install_programs
"""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Optional

import torch
from torch import fx, nn

from lucid_fx._fallback import keep_attributes, restore_attributes
from lucid_fx._meta import FOLDED_FLOPS, OBSERVERS
from lucid_fx._convert_report import graph_facts, model_report
from lucid_fx._copy import copy_model
from lucid_fx._placement import ConvertReport
from lucid_fx._validate import check_backend_device, model_device, require_float32, require_prepared
from lucid_fx.kernels.target import check_backend, resolve_target
from lucid_fx.pipeline import CONVERT_PASSES, ConvertContext, run_passes
from lucid_fx._prepared_registry import registry_of
from lucid_fx.registry import Registry, current_registry

__all__ = ["convert", "ConvertReport"]


def _uncalibrated(gm: fx.GraphModule):
    for name, observer in getattr(gm, OBSERVERS).items():
        if getattr(observer, "has_data", True) is False:
            yield name


def _node_reading(model: nn.Module, name: str) -> str:
    """`` at node 'x'`` for the graph node that reads tensor ``name`` (a get_attr of it, or a call of its module)."""
    owner = name.rsplit(".", 1)[0] if "." in name else ""
    for path, gm in model.named_modules():
        if not isinstance(gm, fx.GraphModule):
            continue
        prefix = f"{path}." if path else ""
        for node in gm.graph.nodes:
            if (node.op, prefix + str(node.target)) in (("get_attr", name), ("call_module", owner)):
                return f" (read by node {node.name!r})"
    return ""


def _require_data(model: nn.Module) -> None:
    # A weight on meta has a shape and no values: quantizing it failed deep in a reduction, and a
    # converted weight moved there later ran the kernels' shape-only meta path, returning garbage.
    named = itertools.chain(
        (("parameter", n, t) for n, t in model.named_parameters()), (("buffer", n, t) for n, t in model.named_buffers())
    )
    for kind, name, tensor in named:
        if tensor.is_meta:
            raise ValueError(
                f"convert: {kind} {name!r}{_node_reading(model, name)} is on the meta device, so it holds no values to "
                "quantize. Load the real weights first (model.to_empty(device='cpu') then model.load_state_dict(state), "
                "or load_state_dict(state, assign=True)), calibrate, then convert"
            )


def _strip_qat(gm: nn.Module) -> None:
    # QAT trains through fake-quantized weights; the int8 weight is made from the trained one
    # (with the qparams it trained with: the fake quant stays in the weight-observer container).
    for module in gm.modules():
        if torch.nn.utils.parametrize.is_parametrized(module, "weight"):
            # A deep copy of a parametrized module shares its generated class, and removing a
            # parametrization deletes the class's property: without a class of its own, converting
            # a copy broke the weight of the prepared model it was copied from.
            cls = type(module)
            body = {k: v for k, v in vars(cls).items() if k not in ("__dict__", "__weakref__")}
            module.__class__ = type(cls.__name__, cls.__bases__, body)
            torch.nn.utils.parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)


def _convert_graph(gm: fx.GraphModule, ctx: ConvertContext) -> fx.GraphModule:
    missing = list(_uncalibrated(gm))
    if missing:
        where = f" in {ctx.path}" if ctx.path else ""
        skipped = {name: int(getattr(getattr(gm, OBSERVERS)[name], "nonfinite_count", 0)) for name in missing}
        if any(skipped.values()):  # calibrated, on NaN or ±inf alone
            raise ValueError(
                f"convert: the observers of node(s) {', '.join(missing)}{where} saw only NaN or ±inf values "
                f"({sum(skipped.values())} skipped), no finite one: clean the calibration data (torch.nan_to_num) or "
                "find the op that makes them, then calibrate again"
            )
        raise ValueError(
            f"convert: the observers of node(s) {', '.join(missing)}{where} saw no data; run "
            "lucid_fx.calibrate(prepared, batches) before convert"
        )
    _strip_qat(gm)
    gm.eval()
    flops, opaque = graph_facts(gm, ctx.registry)  # on the prepared nodes, before folding replaces them
    converted = run_passes(gm, ctx, CONVERT_PASSES)
    ctx.reports[ctx.path].flops, ctx.reports[ctx.path].opaque = flops, opaque
    ctx.reports[ctx.path].folded_flops = gm.meta.get(FOLDED_FLOPS, 0)
    return converted


def _convert_tree(model: nn.Module, ctx: ConvertContext) -> nn.Module:
    # Children first: an untraceable module kept float may hold prepared graphs inside.
    for name, child in list(model.named_children()):
        if name == OBSERVERS:
            continue
        new = _convert_tree(child, replace(ctx, path=f"{ctx.path}.{name}" if ctx.path else name))
        if new is not child:  # a parent may read the child's plain attributes (self.conv1.stride)
            setattr(model, name, keep_attributes(child, new))
    if isinstance(model, fx.GraphModule) and hasattr(model, OBSERVERS):
        return _convert_graph(model, ctx)
    return model


def convert(
    prepared: nn.Module,
    *,
    backend: Optional[str] = None,
    reference: bool = False,
    inplace: bool = False,
    registry: Optional[Registry] = None,
) -> nn.Module:
    """Lower a calibrated prepared model to int8 kernels (``torch.ops.lucid_fx.*``).

    Args:
        prepared: the result of :func:`lucid_fx.prepare` after :func:`lucid_fx.calibrate`.
        backend: ``"cpu"`` or ``"cuda"`` (default: the one given to prepare).
        reference: give the simulated model instead (float ops between quantize -> dequantize).
        inplace: convert ``prepared`` itself instead of a copy.
        registry: rule tables (default: the current registry), for custom lowerings.

    Returns:
        The quantized model; ``model.lucid_fx_convert_report`` (a :class:`ConvertReport`) says which
        ops run as int8 kernels, every region that stayed float and why, and the share of matrix
        FLOPs that runs in int8.

    Example:
        >>> import torch, lucid_fx
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
        >>> prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(4, 8),))
        >>> _ = lucid_fx.calibrate(prepared, [torch.randn(4, 8) for _ in range(4)], progress=False)
        >>> qmodel = lucid_fx.convert(prepared)
        >>> [n.target.__name__ for n in qmodel.graph.nodes if n.op == "call_function"]
        ['quantize_per_tensor', 'linear', 'linear']
    """
    require_prepared("convert", prepared)
    report = getattr(prepared, "lucid_fx_report", None)
    backend = check_backend(backend or (report.backend if report is not None else "cpu"))
    check_backend_device("convert", prepared, backend)
    require_float32("convert", prepared)
    _require_data(prepared)
    ctx = ConvertContext(registry_of(prepared, registry) or current_registry(), resolve_target(backend, model_device(prepared)), reference)
    work = prepared if inplace else restore_attributes(copy_model(prepared))
    converted = _convert_tree(work, ctx)
    converted.lucid_fx_convert_report = model_report(ctx.target.backend, ctx.reports, report)
    return converted
