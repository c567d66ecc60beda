"""equalize: data-free cross-layer equalization (Nagel et al. 2019, "Data-Free Quantization
Through Weight Equalization and Bias Correction", section 4.1).

For two layers in a row, ``conv2(f(conv1(x)))`` with ``f`` a ReLU (or nothing, or a batch norm
then a ReLU), scaling output channel ``i`` of ``conv1`` by ``1/s_i`` and input channel ``i`` of
``conv2`` by ``s_i`` computes the same function, because ``f(x / s) = f(x) / s`` for ``s > 0``.
With ``s_i = sqrt(r1_i * r2_i) / r2_i`` (``r1_i`` the range of ``conv1``'s output channel ``i``,
``r2_i`` that of ``conv2``'s input channel ``i``) both become ``sqrt(r1_i * r2_i)``: a channel
that a depthwise conv amplifies a thousandfold is no longer a thousand times smaller than its
neighbours in the tensor between them, where one int8 grid serves every channel. Batch norms
are folded into their convs first; every pair is rescaled in turn until the scales settle.

ReLU6 does not commute with scaling (its clip is at 6 whatever the channel's scale). ``relu6``
chooses: ``"relu"`` replaces a ReLU6 between an equalized pair by a ReLU, as the paper does
(exact wherever no value reaches 6; the report's ``float_sqnr_db`` says how far the float model
moved on the example inputs), ``"clip"`` by a per-channel clip at ``6 / s_i`` (exact, but
lucid_fx runs a per-channel clip in float), ``"keep"`` leaves such pairs alone.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from lucid_fx.quantization import fuse_modules
from lucid_fx.transforms._dataflow import LAYER_CALLS, Call, Dataflow, call_model, layer_module, module_of, record
from lucid_fx.transforms.report import TransformReport, attach, require_eval, output_sqnr_db

__all__ = ["equalize", "ChannelClip"]

_F = "torch.nn.functional."
_BATCH_NORMS = {nn.Conv1d: nn.BatchNorm1d, nn.Conv2d: nn.BatchNorm2d, nn.Conv3d: nn.BatchNorm3d}
# Activations with f(x / s) = f(x) / s for s > 0: the scale passes through them.
_HOMOGENEOUS = frozenset({_F + "relu", "torch.relu", "torch.relu_", "torch.Tensor.relu", "torch.Tensor.relu_", _F + "leaky_relu"})
_RELU6_MODES = ("relu", "clip", "keep")
_HARDTANH = inspect.signature(F.hardtanh)
_BATCH_NORM = inspect.signature(F.batch_norm)


class ChannelClip(nn.Module):
    """``clamp(x, 0, upper[c])`` per channel ``c`` (dim 1, or the last dim for a linear's
    output): a ReLU6 after its channels were scaled by ``1 / s``, with ``upper = 6 / s``."""

    def __init__(self, upper: torch.Tensor, dim: int = 1, inplace: bool = False) -> None:
        super().__init__()
        self.dim, self.inplace = dim, inplace
        self.register_buffer("upper", upper.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = [1] * x.dim()
        shape[self.dim] = -1
        return torch.minimum(torch.relu(x), self.upper.reshape(shape))


@dataclass
class _Pair:
    first: str
    second: str
    bn: Optional[str]  # folded into ``first`` before ranges are taken
    act: str  # "", "relu" (any homogeneous activation) or "relu6"
    act_module: Optional[str]  # the module running a ReLU6, when it is one that can be replaced


def _batch_norm(flow: Dataflow, model: nn.Module, call: Call, layer: nn.Module) -> Optional[str]:
    """The eval-mode batch-norm module ``call`` runs, if it can fold into ``layer``."""
    if call.name != _F + "batch_norm":
        return None
    bound = _BATCH_NORM.bind(*call.args, **call.kwargs).arguments
    name = module_of(flow, model, bound.get("running_mean"), (_BATCH_NORMS.get(type(layer), ()),))
    if name is None or bound.get("training") or call.module != name or flow.module_calls[name] != 1:
        return None
    return name if model.get_submodule(name).num_features == layer.weight.shape[0] else None


def _activation(call: Call) -> str:
    if call.name in _HOMOGENEOUS:
        return "relu"
    if call.name == _F + "relu6":
        return "relu6"
    if call.name == _F + "hardtanh":
        bound = _HARDTANH.bind(*call.args, **call.kwargs)
        bound.apply_defaults()
        if (bound.arguments["min_val"], bound.arguments["max_val"]) == (0.0, 6.0):
            return "relu6"
    return ""


def _follow(flow: Dataflow, model: nn.Module, first: Call, name: str) -> Tuple[Optional[_Pair], str]:
    """The pair that starts at layer call ``first``: (pair, "") or (None, why not)."""
    key, bn, act, act_call = first.writes[0], None, "", None
    while True:
        readers = flow.readers(key)
        if key in flow.outputs or len(readers) != 1 or readers[0].reads[:1] != [key]:
            return None, ""  # the value is read elsewhere too (a residual add, a model output): no pair
        nxt = readers[0]
        if bn is None and not act and _batch_norm(flow, model, nxt, model.get_submodule(name)):
            bn = _batch_norm(flow, model, nxt, model.get_submodule(name))
        elif not act and _activation(nxt):
            act, act_call = _activation(nxt), nxt
        elif nxt.name in LAYER_CALLS:
            second = layer_module(flow, model, nxt)
            if second is None or nxt.name != first.name:
                return None, ""
            a, b = model.get_submodule(name), model.get_submodule(second)
            if a.weight.shape[0] != (b.in_channels if isinstance(b, nn.modules.conv._ConvNd) else b.in_features):
                return None, ""
            act_module = None
            if act == "relu6" and act_call.module and flow.module_calls[act_call.module] == 1:
                if isinstance(model.get_submodule(act_call.module), (nn.ReLU6, nn.Hardtanh)):
                    act_module = act_call.module
            return _Pair(name, second, bn, act, act_module), ""
        else:
            return None, ""
        key = nxt.writes[0]


def _pairs(flow: Dataflow, model: nn.Module) -> Tuple[List[_Pair], Dict[str, str]]:
    """Every equalizable pair, and the batch norm after each layer that has one."""
    pairs, folds = [], {}
    for call in flow.calls:
        name = layer_module(flow, model, call) if call.name in LAYER_CALLS else None
        if name is not None:
            pair, _ = _follow(flow, model, call, name)
            if pair is not None:
                pairs.append(pair)
                if pair.bn:
                    folds[pair.first] = pair.bn
            readers = flow.readers(call.writes[0])
            if len(readers) == 1 and call.writes[0] not in flow.outputs:
                bn = _batch_norm(flow, model, readers[0], model.get_submodule(name))
                if bn:
                    folds[name] = bn
    return pairs, folds


def _out_ranges(layer: nn.Module) -> torch.Tensor:
    return layer.weight.detach().abs().flatten(1).amax(1)


def _grouped(layer: nn.Module) -> torch.Tensor:
    """The weight as [groups, outputs per group, inputs per group, rest]."""
    groups = getattr(layer, "groups", 1)
    w = layer.weight
    return w.reshape(groups, w.shape[0] // groups, w.shape[1], -1)


def _in_ranges(layer: nn.Module) -> torch.Tensor:
    return _grouped(layer).detach().abs().amax(dim=(1, 3)).flatten()


def _scale_pair(first: nn.Module, second: nn.Module) -> torch.Tensor:
    r1, r2 = _out_ranges(first), _in_ranges(second)
    scale = torch.where((r1 > 0) & (r2 > 0), torch.sqrt(r1 / r2.clamp_min(1e-30)), torch.ones_like(r1))
    with torch.no_grad():
        first.weight.div_(scale.reshape([-1] + [1] * (first.weight.dim() - 1)))
        if first.bias is not None:
            first.bias.div_(scale)
        groups = getattr(second, "groups", 1)
        _grouped(second).mul_(scale.reshape(groups, 1, -1, 1))
    return scale


def _set(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, attr, module)


def equalize(
    model: nn.Module,
    example_inputs: Any,
    *,
    relu6: str = "relu",
    iterations: int = 100,
    tolerance: float = 1e-4,
    inplace: bool = False,
) -> nn.Module:
    """Cross-layer equalization of every pair of convs (or linears) that feed each other through
    at most a batch norm and a ReLU, depthwise and grouped convs included; batch norms of the
    equalized layers are folded first. Returns the transformed float model (a copy unless
    ``inplace=True``) with its report appended to ``model.lucid_fx_transforms``.

    Args:
        model: an eval-mode model.
        example_inputs: one batch (a tuple of ``forward``'s positional inputs, a tensor or a
            dict); the model runs on it once to find which layer feeds which.
        relu6: ``"relu"``, ``"clip"`` or ``"keep"``: what a ReLU6 between two layers becomes
            (module docstring).
        iterations, tolerance: rescale every pair in turn until no scale differs from 1 by
            more than ``tolerance``, at most ``iterations`` rounds.

    Example:
        >>> import torch, lucid_fx
        >>> from torch import nn
        >>> _ = torch.manual_seed(0)
        >>> model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.ReLU(), nn.Conv2d(8, 4, 1)).eval()
        >>> with torch.no_grad():
        ...     _ = model[0].weight[:4].mul_(100)
        >>> x = torch.randn(2, 3, 5, 5)
        >>> equalized = lucid_fx.equalize(model, (x,))
        >>> print(equalized.lucid_fx_transforms[-1].changed[0])
        0 -> 2 (relu): 8 channels, scales 1.1 to 14
        >>> torch.allclose(equalized(x), model(x), rtol=1e-4, atol=1e-5)
        True
    """
    if relu6 not in _RELU6_MODES:
        raise ValueError(f"equalize: relu6 must be one of {_RELU6_MODES}, got {relu6!r}")
    require_eval(model, "equalize")
    work = model if inplace else copy.deepcopy(model)
    flow = record(work, example_inputs)
    pairs, folds = _pairs(flow, work)
    report = TransformReport("equalize")
    kept = []
    for pair in pairs:
        if pair.act == "relu6" and (relu6 == "keep" or pair.act_module is None):
            why = "relu6='keep'" if relu6 == "keep" else "the ReLU6 is a function call, not a module that can be replaced"
            report.skipped.append(f"{pair.first} -> {pair.second}: joined by a ReLU6 ({why})")
        else:
            kept.append(pair)
    with torch.no_grad():
        reference = call_model(model, example_inputs)
    in_pairs = {p.first for p in kept} | {p.second for p in kept}
    groups = [[layer, bn] for layer, bn in folds.items() if layer in in_pairs]
    if groups:
        fuse_modules(work, groups, inplace=True)
    totals = {p.first: torch.ones(work.get_submodule(p.first).weight.shape[0]) for p in kept}
    for _ in range(iterations if kept else 0):
        change = 0.0
        for pair in kept:
            scale = _scale_pair(work.get_submodule(pair.first), work.get_submodule(pair.second))
            totals[pair.first] *= scale
            change = max(change, float((scale - 1).abs().max()))
        if change < tolerance:
            break
    for pair in kept:
        total = totals[pair.first]
        if pair.act == "relu6":
            old = work.get_submodule(pair.act_module)
            dim = -1 if isinstance(work.get_submodule(pair.first), nn.Linear) else 1
            new = nn.ReLU(inplace=old.inplace) if relu6 == "relu" else ChannelClip(6.0 / total, dim, old.inplace)
            _set(work, pair.act_module, new.train(old.training))
        how = f" ({'batch norm folded, ' if pair.bn else ''}{pair.act or 'linear'}{' -> ' + relu6 if pair.act == 'relu6' else ''})"
        report.changed.append(f"{pair.first} -> {pair.second}{how}: {total.numel()} channels, "
                              f"scales {float(total.min()):.2g} to {float(total.max()):.2g}")
    with torch.no_grad():
        report.float_sqnr_db = output_sqnr_db(reference, call_model(work, example_inputs))
    return attach(work, report)
