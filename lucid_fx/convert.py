"""convert / quantize: calibrated graphs become int8 kernels (or their simulated reference).

    fold_batchnorm -> lower_to_int8   (backend "cpu" or "cuda")
    fold_batchnorm -> insert_qdq      (reference=True)
"""

from __future__ import annotations

import copy
import itertools
from typing import Any, Iterable, Optional

import torch
from torch import fx, nn

from lucid_fx._activation_qparams import record_activation_qparams
from lucid_fx._validate import check_backend_device, model_device, require_float32, require_module, require_prepared
from lucid_fx.calibrate import calibrate
from lucid_fx.kernels import weight_quant_range
from lucid_fx.passes.fold_batchnorm import fold_batchnorm
from lucid_fx.passes.insert_observers import OBSERVERS
from lucid_fx.passes.insert_qdq import insert_qdq
from lucid_fx.passes.lower_to_int8 import ConvertReport, lower_to_int8, lowering_table
from lucid_fx.prepare import BACKENDS, prepare
from lucid_fx.quantization.qconfig import QConfigMapping
from lucid_fx.registry import Registry, current_registry

__all__ = ["convert", "quantize", "ConvertReport"]


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


def _convert_graph(gm: fx.GraphModule, backend: str, reference: bool, registry: Registry, path: str):
    missing = list(_uncalibrated(gm))
    if missing:
        where = f" in {path}" if path else ""
        raise ValueError(
            f"convert: the observers of node(s) {', '.join(missing)}{where} saw no data; run "
            "lucid_fx.calibrate(prepared, batches) before convert"
        )
    _strip_qat(gm)
    gm.eval()
    fold_batchnorm(gm)
    weight_range = weight_quant_range(model_device(gm) or torch.device("cuda" if backend == "cuda" else "cpu"))
    if reference:
        converted = insert_qdq(gm, weight_range, set(lowering_table(registry.lowerings, backend)))
        return record_activation_qparams(converted), ConvertReport("reference")
    converted, report = lower_to_int8(gm, registry.lowerings, backend, weight_range)
    return record_activation_qparams(converted), report


def _convert_tree(model: nn.Module, backend, reference, registry, reports, path="") -> nn.Module:
    # Children first: an untraceable module kept float may hold prepared graphs inside.
    for name, child in list(model.named_children()):
        if name == OBSERVERS:
            continue
        full = f"{path}.{name}" if path else name
        new = _convert_tree(child, backend, reference, registry, reports, full)
        if new is not child:
            setattr(model, name, new)
    if isinstance(model, fx.GraphModule) and hasattr(model, OBSERVERS):
        converted, report = _convert_graph(model, backend, reference, registry, path)
        reports[path] = report
        return converted
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
        The quantized model; ``model.lucid_fx_convert_report`` says which ops run as int8
        kernels and which stayed float (and why).

    Example:
        >>> import torch, lucid_fx
        >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2)).eval()
        >>> prepared = lucid_fx.prepare(model, example_inputs=(torch.randn(4, 8),))
        >>> _ = lucid_fx.calibrate(prepared, [torch.randn(4, 8) for _ in range(4)], progress=False)
        >>> qmodel = lucid_fx.convert(prepared)
        >>> [n.target.__name__ for n in qmodel.graph.nodes if n.op == "call_function"]
        ['quantize_per_tensor', 'linear', 'linear', 'dequantize_per_tensor']
    """
    require_prepared("convert", prepared)
    report = getattr(prepared, "lucid_fx_report", None)
    backend = backend or (report.backend if report is not None else "cpu")
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(BACKENDS)}")
    check_backend_device("convert", prepared, backend)
    require_float32("convert", prepared)
    _require_data(prepared)
    work = prepared if inplace else copy.deepcopy(prepared)
    reports: dict = {}
    converted = _convert_tree(work, backend, reference, registry or current_registry(), reports)
    converted.lucid_fx_convert_report = reports[""] if set(reports) == {""} else reports
    return converted


def quantize(
    model: nn.Module,
    example_inputs: Any,
    calibration_data: Iterable,
    qconfig_mapping: Optional[QConfigMapping] = None,
    *,
    backend: Optional[str] = None,
    reference: bool = False,
    progress: bool = False,
    registry: Optional[Registry] = None,
    **prepare_options: Any,
) -> nn.Module:
    """prepare -> calibrate -> convert in one call; ``model`` itself is left unchanged."""
    require_module("quantize", model)
    prepared = prepare(model, qconfig_mapping, example_inputs, backend=backend, registry=registry, **prepare_options)
    calibrate(prepared, calibration_data, progress=progress)
    return convert(prepared, backend=backend, reference=reference, inplace=True, registry=registry)
