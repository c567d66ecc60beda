"""correct_bias: empirical bias correction (Nagel et al. 2019, section 4.2).

Rounding a layer's weights to int8 shifts the mean of its output: ``E[W_q x] - E[W x] =
(W_q - W) E[x]`` per output channel is not zero, and a batch norm or a residual add downstream
does not remove it. This correction measures that shift on calibration batches and subtracts it
from the layer's bias, so the int8 layer's output has the float layer's mean.

Of the paper's two estimates of ``E[x]`` this is the empirical one: the float model runs on the
calibration batches, and ``(W_q - W) * x`` is computed on each layer's real inputs (the conv
itself, so zero padding at the borders counts as it does in the model). The data-free one reads
``E[x]`` off the batch norm before the layer, which needs a batch norm and a ReLU right before
every layer; the data is at hand anyway where ``quantize`` is called.

``W_q`` is the weight as ``convert`` quantizes it: the QConfig's weight observer on the weight,
per-channel symmetric codes on the device's kernel grid (the Target's ``layer_weight_range``).
"""

from __future__ import annotations

import copy
from typing import Dict, Iterable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lucid_fx.kernels.target import resolve_target
from lucid_fx.quantization import QConfigMapping, dequantize, get_default_qconfig_mapping
from lucid_fx.quantization.weight import quantize_layer_weight
from lucid_fx.transforms._dataflow import call_model
from lucid_fx.transforms.report import TransformReport, attach, require_eval, output_sqnr_db

__all__ = ["correct_bias", "int8_weight"]

_LAYERS = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Linear)


def int8_weight(weight: torch.Tensor, observer: Optional[nn.Module], target, groups: int = 1) -> torch.Tensor:
    """``weight`` rounded as ``convert`` rounds it for ``target`` (a :class:`~lucid_fx.kernels.target.Target`;
    :func:`~lucid_fx.quantization.weight.quantize_layer_weight`), back in float."""
    codes, scale = quantize_layer_weight(weight.detach(), observer, target, groups)
    return dequantize(codes, scale, torch.zeros_like(scale, dtype=torch.int64), ch_axis=0).to(weight.dtype)


def _shift(layer: nn.Module, x: torch.Tensor, error: torch.Tensor) -> torch.Tensor:
    """Per output channel, the sum over this call of what ``error`` (``W_q - W``) adds to the output."""
    if isinstance(layer, nn.Linear):
        return F.linear(x, error).reshape(-1, error.shape[0]).sum(0)
    out = layer._conv_forward(x, error, None)
    return out.transpose(0, 1).reshape(error.shape[0], -1).sum(1)


def correct_bias(
    model: nn.Module,
    calibration_data: Iterable,
    qconfig_mapping: Optional[QConfigMapping] = None,
    *,
    backend: Optional[str] = None,
    inplace: bool = False,
) -> nn.Module:
    """Subtract from each conv and linear's bias the mean shift that int8 weights add to its
    output, measured on ``calibration_data`` (module docstring). Layers whose QConfig is ``None``
    are left as they are; a layer without a bias gets one. Returns the corrected float model (a
    copy unless ``inplace=True``), with its report appended to ``model.lucid_fx_transforms``.

    Call it last, just before ``quantize``: it corrects for the weights as they are, so a later
    ``equalize`` would undo it.

    Args:
        model: an eval-mode model.
        calibration_data: batches, as ``lucid_fx.calibrate`` takes them.
        qconfig_mapping: the mapping ``prepare`` will get (default: ``get_default_qconfig_mapping()``).
        backend: ``"cpu"`` or ``"cuda"``: whose weight grid to round to (default: the model's device).

    Example:
        >>> import torch, lucid_fx
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Linear(64, 8).eval()
        >>> batches = [torch.rand(16, 64) + 1 for _ in range(4)]  # inputs with a mean far from 0
        >>> corrected = lucid_fx.correct_bias(model, batches)
        >>> corrected.lucid_fx_transforms[-1].changed[0].startswith("the model: mean shift of 8 channels removed")
        True
        >>> def mean_error(m):  # the int8 model's output mean minus the float model's, worst channel
        ...     x = torch.rand(256, 64) + 1
        ...     return float((lucid_fx.quantize(m, (x,), batches)(x) - model(x)).detach().mean(0).abs().max())
        >>> mean_error(corrected) < mean_error(model) / 2
        True
    """
    require_eval(model, "correct_bias")
    mapping = qconfig_mapping if qconfig_mapping is not None else get_default_qconfig_mapping()
    work = model if inplace else copy.deepcopy(model)
    first = next(work.parameters(), None)
    device = torch.device("cuda") if backend == "cuda" else (first.device if first is not None else torch.device("cpu"))
    target = resolve_target(backend, device)
    errors: Dict[str, torch.Tensor] = {}
    for name, layer in work.named_modules():
        qconfig = mapping.qconfig_for(name, type(layer)) if isinstance(layer, _LAYERS) else None
        if qconfig is not None:
            errors[name] = int8_weight(layer.weight, qconfig.weight(), target, getattr(layer, "groups", 1)) - layer.weight.detach()
    sums: Dict[str, torch.Tensor] = {}
    counts: Dict[str, int] = {}

    def hook(name: str):
        def measure(layer, args, output):
            sums[name] = sums.get(name, 0) + _shift(layer, args[0], errors[name]).double()
            counts[name] = counts.get(name, 0) + output.numel() // errors[name].shape[0]

        return measure

    handles = [work.get_submodule(name).register_forward_hook(hook(name)) for name in errors]
    reference, batches = None, 0
    try:
        with torch.no_grad():
            for batch in calibration_data:
                out = call_model(work, batch)
                if reference is None:
                    reference, first_batch = out, batch
                batches += 1
    finally:
        for handle in handles:
            handle.remove()
    if batches == 0:
        raise ValueError("correct_bias: the calibration data was empty; pass at least one batch")
    report = TransformReport("correct_bias")
    with torch.no_grad():
        for name in errors:
            if name not in sums:
                report.skipped.append(f"{name}: never called on the calibration data")
                continue
            layer = work.get_submodule(name)
            shift = (sums[name] / counts[name]).to(layer.weight.dtype)
            if layer.bias is None:
                layer.bias = nn.Parameter(torch.zeros_like(shift))
            layer.bias.sub_(shift)
            report.changed.append(f"{name or 'the model'}: mean shift of {shift.numel()} channels removed, largest {float(shift.abs().max()):.2g}")
        report.float_sqnr_db = output_sqnr_db(reference, call_model(work, first_batch))
    return attach(work, report)
