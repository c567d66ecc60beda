"""smooth_quant: migrate activation outliers into the weights of the linears after a norm
(Xiao et al. 2022, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models").

A few hidden channels of a transformer's LayerNorm/RMSNorm output are tens of times larger than
the rest; one per-tensor int8 grid for the linear's input then has a step that the ordinary
channels barely span. Dividing channel ``j`` of the norm's output by ``s_j`` (the norm's weight,
and bias, absorb ``1/s_j``) and multiplying input column ``j`` of every linear that reads it by
``s_j`` computes the same function, with

    s_j = max|X_j| ** alpha / max|W_j| ** (1 - alpha)

(``max|X_j|`` over the calibration batches, ``max|W_j|`` over the column in all those linears, so
q/k/v projections that read one norm share one ``s``). ``alpha`` is the migration strength: at 1
every activation channel's range becomes 1 and all of it moves into the weights, whose grids are
per output channel and so absorb it better; at 0 the weights' columns are evened out instead.

A norm is smoothed only when linears alone read its output (through reshapes, slices that keep
the last dim, casts), and only when scaling its weight is seen to scale its output (a
``(1 + weight) * x`` norm is left alone).
"""

from __future__ import annotations

import copy
from typing import Any, Dict, Iterable, List, Tuple

import torch
from torch import nn

from lucid_fx.transforms._dataflow import Call, Dataflow, Key, call_model, layer_module, record
from lucid_fx.transforms.report import TransformReport, attach, require_eval, output_sqnr_db

__all__ = ["smooth_quant"]

_LINEAR = "torch.nn.functional.linear"
# Calls whose output holds the input's last-dim channels unchanged, in the same places.
_SAME_VALUES = frozenset({"torch.Tensor.to", "torch.Tensor.float", "torch.Tensor.type_as", "torch.Tensor.contiguous", "torch.Tensor.clone"})
_RESHAPES = frozenset({"torch.Tensor.view", "torch.Tensor.reshape", "torch.reshape"})
_NOT_LAST_DIM = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LocalResponseNorm)


def _is_norm(module: nn.Module) -> bool:
    """A LayerNorm or RMSNorm (torch's, or a class named so, as transformers writes them) with a
    weight per channel of the last dim."""
    if isinstance(module, _NOT_LAST_DIM):
        return False
    weight = getattr(module, "weight", None)
    return "Norm" in type(module).__name__ and isinstance(weight, nn.Parameter) and weight.dim() == 1


def _keeps_last_dim(call: Call, key: Key) -> bool:
    """Whether ``call`` passes value ``key`` on with its last-dim channels where they were."""
    out, source = call.out, call.args[0] if call.args else None
    if not (isinstance(out, torch.Tensor) and isinstance(source, torch.Tensor)) or call.reads[:1] != [key]:
        return False
    if out.dim() == 0 or out.shape[-1] != source.shape[-1]:
        return False
    if call.name in _SAME_VALUES:
        return True
    if call.name in _RESHAPES:
        return source.is_contiguous()  # the trailing dim keeps its size, so each j stays column j
    if call.name == "torch.Tensor.__getitem__":
        index = call.args[1] if isinstance(call.args[1], tuple) else (call.args[1],)
        if any(isinstance(i, (torch.Tensor, list)) or i is Ellipsis for i in index):
            return False  # advanced indexing, or an index counted from the end
        used = [i for i in index if i is not None]
        if len(used) < source.dim():
            return True
        last = used[-1]
        return isinstance(last, slice) and last.start in (None, 0) and last.stop is None and last.step in (None, 1)
    return False


def _readers(flow: Dataflow, model: nn.Module, key: Key) -> Tuple[List[str], str]:
    """The linears that read ``key`` (through calls that keep the channels), or ([], why not)."""
    linears, todo = [], [key]
    while todo:
        value = todo.pop()
        if value in flow.outputs:
            return [], "its output is an output of the model"
        for call in flow.readers(value):
            if call.name == _LINEAR and call.reads[0] == value:
                name = layer_module(flow, model, call)
                if name is None:
                    return [], f"a linear in {call.module or 'the model'} reads it with weights used elsewhere too"
                linears.append(name)
            elif _keeps_last_dim(call, value):
                todo.append(call.writes[0])
            else:
                return [], f"{call.name.rpartition('.')[2]} in {call.module or 'the model'} reads it"
    return linears, "" if linears else "nothing reads it"


def _collect(model: nn.Module, norms: List[str], data: Iterable) -> Tuple[Dict[str, torch.Tensor], Dict[str, tuple], Any, Any]:
    """Per norm: the largest |output| of each channel over ``data``, and one call's (args, kwargs,
    output); the model's output on the first batch and that batch."""
    amax: Dict[str, torch.Tensor] = {}
    sample: Dict[str, tuple] = {}

    def hook(name):
        def observe(module, args, kwargs, output):
            out = output.detach()
            found = out.abs().reshape(-1, out.shape[-1]).amax(0).float()
            amax[name] = torch.maximum(amax[name], found) if name in amax else found
            sample.setdefault(name, (args, kwargs, out.clone()))

        return observe

    handles = [model.get_submodule(n).register_forward_hook(hook(n), with_kwargs=True) for n in norms]
    reference = first = None
    try:
        with torch.no_grad():
            for batch in data:
                out = call_model(model, batch)
                if first is None:
                    reference, first = out, batch
    finally:
        for handle in handles:
            handle.remove()
    return amax, sample, reference, first


def _scale_norm(norm: nn.Module, factor: torch.Tensor) -> None:
    norm.weight.mul_(factor.to(norm.weight.dtype))
    if getattr(norm, "bias", None) is not None:
        norm.bias.mul_(factor.to(norm.bias.dtype))


def smooth_quant(model: nn.Module, calibration_data: Iterable, *, alpha: float = 0.5, inplace: bool = False) -> nn.Module:
    """Move activation range from every LayerNorm/RMSNorm output into the linears that read it
    (module docstring). Returns the transformed float model (a copy unless ``inplace=True``),
    which computes what ``model`` does, with its report appended to ``model.lucid_fx_transforms``.

    Args:
        model: an eval-mode model.
        calibration_data: batches, as ``lucid_fx.calibrate`` takes them; the first one is also
            run once to find which linears read which norm.
        alpha: migration strength in ``[0, 1]``.

    Example:
        >>> import torch, lucid_fx
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 8)).eval()
        >>> with torch.no_grad():
        ...     _ = model[0].weight[:2].mul_(40)  # two outlier channels
        >>> batches = [torch.randn(4, 16) for _ in range(4)]
        >>> smoothed = lucid_fx.smooth_quant(model, batches)
        >>> print(smoothed.lucid_fx_transforms[-1].changed[0])
        0 -> 1: 16 channels, s 2.2 to 18, largest |input| 74 -> 4.1
        >>> torch.allclose(smoothed(batches[0]), model(batches[0]), rtol=1e-4, atol=1e-5)
        True
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"smooth_quant: alpha is the migration strength, in [0, 1]; got {alpha!r}")
    require_eval(model, "smooth_quant")
    work = model if inplace else copy.deepcopy(model)
    batches = list(calibration_data)
    if not batches:
        raise ValueError("smooth_quant: the calibration data was empty; pass at least one batch")
    flow = record(work, batches[0])
    report = TransformReport("smooth_quant")
    groups: Dict[str, List[str]] = {}
    for name, module in work.named_modules():
        if not _is_norm(module) or name not in flow.module_outputs:
            continue
        outputs = flow.module_outputs[name]
        linears, why = _readers(flow, work, outputs[0]) if len(outputs) == 1 and flow.module_calls[name] == 1 else ([], "it runs more than once")
        if linears:
            groups[name] = linears
        else:
            report.skipped.append(f"{name}: {why}")
    amax, sample, reference, first = _collect(work, list(groups), batches)
    with torch.no_grad():
        for name, linears in groups.items():
            norm, layers = work.get_submodule(name), [work.get_submodule(n) for n in linears]
            wmax = torch.stack([layer.weight.detach().abs().amax(0).float() for layer in layers]).amax(0)
            xmax = amax[name]
            ok = (xmax > 0) & (wmax > 0)
            s = torch.where(ok, xmax.clamp_min(1e-30) ** alpha / wmax.clamp_min(1e-30) ** (1 - alpha), torch.ones_like(xmax))
            s = s.clamp(1e-5, 1e5)
            args, kwargs, before = sample[name]
            _scale_norm(norm, 1 / s)
            after = norm(*args, **kwargs)
            if not torch.allclose(after.float() * s, before.float(), rtol=1e-4, atol=1e-6 * float(before.abs().max())):
                _scale_norm(norm, s)
                report.skipped.append(f"{name}: scaling its weight does not scale its output")
                continue
            for layer in layers:
                layer.weight.mul_(s.to(layer.weight.dtype))
            report.changed.append(f"{name} -> {', '.join(linears)}: {s.numel()} channels, s {float(s.min()):.2g} to "
                                  f"{float(s.max()):.2g}, largest |input| {float(xmax.max()):.2g} -> {float((xmax / s).max()):.2g}")
        report.float_sqnr_db = output_sqnr_db(reference, call_model(work, first))
    return attach(work, report)
