"""Lowering rules for layer norm, RMS norm, group norm and a standalone batch norm (the table entries
are in rules/lowering.py).

Both run as one kernel on the codes (``lucid_fx.layer_norm`` / ``lucid_fx.rms_norm``, in
lucid_fx/kernels/norms.py): the statistics in float32 inside it, the weight and bias float as the
model has them, the output on its own calibrated grid. An RMSNorm written out by hand
(``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w``) reaches this rule as one ``rms_norm``
(rules/patterns.py). Group norm (``lucid_fx.group_norm``) keeps its input's layout: a diffusion or
audio block's convolution -> group norm -> SiLU -> convolution stays channels-last codes throughout. An
instance norm over its input's statistics (style transfer's, a CycleGAN generator's) is the group norm of
one group a channel.
"""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
from torch import fx

from lucid_fx import _meta
from lucid_fx.kernels.channel_lut import batch_norm_tables
from lucid_fx.ops import canonical
from lucid_fx.rules.lowering_context import QValue, watched

__all__ = ["lower_norm", "lower_normalize", "normalize_takes", "lower_group_norm", "lower_batch_norm"]

_ops = torch.ops.lucid_fx
_NO_TENSOR = object()  # an argument given as a node that is not a constant: the rule declines


def _tensor(ctx, value: Any) -> Any:
    """A weight or bias: None, a constant tensor (get_attr), or _NO_TENSOR for one computed in the graph."""
    if value is None:
        return None
    attr = ctx.attr(value) if isinstance(value, fx.Node) else value
    return attr if isinstance(attr, torch.Tensor) else _NO_TENSOR


def _args(ctx, node: fx.Node) -> Optional[Tuple[List[int], Any, Any, float]]:
    """(normalized_shape, weight, bias, eps) of a norm module or call; None where the kernel cannot take it."""
    if node.op == "call_module":
        m = ctx.prepared.get_submodule(node.target)
        shape, weight, bias, eps = m.normalized_shape, m.weight, getattr(m, "bias", None), m.eps
    else:
        args = canonical(node).args
        shape, eps = args.get("normalized_shape"), args.get("eps", 1e-5 if canonical(node).op == "layer_norm" else None)
        weight, bias = _tensor(ctx, args.get("weight")), _tensor(ctx, args.get("bias"))
    shape = [shape] if isinstance(shape, int) else list(shape) if isinstance(shape, (list, tuple, torch.Size)) else None
    if shape is None or not all(isinstance(s, int) for s in shape) or _NO_TENSOR in (weight, bias):
        return None
    eps = torch.finfo(torch.float32).eps if eps is None else eps  # F.rms_norm's default
    return shape, weight, bias, float(eps) if isinstance(eps, (int, float)) else None


def _constant(ctx, node: fx.Node, what: str, value: Optional[torch.Tensor]) -> Optional[fx.Node]:
    return None if value is None else ctx.constant(f"{node.name}_{what}", value.detach().float())


def lower_norm(ctx, members, resolve) -> Optional[QValue]:  # layer_norm / rms_norm -> lucid_fx.layer_norm / rms_norm
    node = members[0]
    call = canonical(node)
    source = resolve(call.args.get("input"))
    x = ctx.quant_or_none(source)
    found = _args(ctx, node)
    if x is None or found is None or found[3] is None or ctx.qparams_of(node) is None:
        return None
    shape, weight, bias, eps = found
    w, b = _constant(ctx, node, "weight", weight), _constant(ctx, node, "bias", bias)
    scale, zp, _ = ctx.qparams_of(node)
    if call.op == "layer_norm":
        out = ctx.call(_ops.layer_norm, x.node, x.scale, x.zero_point, shape, w, b, eps, scale, zp)
    else:
        out = ctx.call(_ops.rms_norm, x.node, x.scale, x.zero_point, shape, w, eps, scale, zp)
    return ctx.output_qvalue(node, out)


def normalize_takes(node: fx.Node) -> bool:
    """Whether ``F.normalize`` at ``node`` is an L2 normalization over its input's last dim (the one
    :func:`lower_normalize` takes; explain asks too)."""
    args, source = canonical(node).args, watched(canonical(node).args.get("input"))
    ndim = len(getattr(getattr(source, "meta", {}).get(_meta.TENSOR_META), "shape", ()))
    return ndim > 0 and args.get("p", 2.0) == 2 and args.get("dim", 1) in (-1, ndim - 1) and args.get("out") is None


def lower_normalize(ctx, members, resolve) -> Optional[QValue]:  # F.normalize(x, dim=-1) -> lucid_fx.rms_norm
    """``x / max(||x||, eps)`` over the last dim is the RMS norm of weight ``1 / sqrt(d)`` and eps ``eps^2 / d``:
    ``x / sqrt(sum(x^2) + eps^2)``, the same value but where the norm is below eps (cosine-similarity heads,
    Swin v2's cosine attention, embeddings)."""
    node = members[0]
    call = canonical(node)
    source = resolve(call.args.get("input"))
    x = ctx.quant_or_none(source)
    if x is None or not normalize_takes(node) or ctx.qparams_of(node) is None:
        return None
    d = int(source.meta[_meta.TENSOR_META].shape[-1])
    weight = ctx.constant(f"{node.name}_weight", torch.full((d,), d ** -0.5))
    scale, zp, _ = ctx.qparams_of(node)
    eps = float(call.args.get("eps", 1e-12)) ** 2 / d
    return ctx.output_qvalue(node, ctx.call(_ops.rms_norm, x.node, x.scale, x.zero_point, [d], weight, eps, scale, zp))


def _group_norm_args(ctx, node: fx.Node) -> Optional[Tuple[int, Any, Any, float]]:
    """(num_groups, weight, bias, eps) of a group norm module or call over constants, or None."""
    if node.op == "call_module":
        m = ctx.prepared.get_submodule(node.target)
        found = (m.num_groups, m.weight, m.bias, m.eps)
    else:
        args = canonical(node).args
        found = (args.get("num_groups"), _tensor(ctx, args.get("weight")), _tensor(ctx, args.get("bias")), args.get("eps", 1e-5))
    groups, weight, bias, eps = found
    if not isinstance(groups, int) or _NO_TENSOR in (weight, bias) or not isinstance(eps, (int, float)):
        return None
    return groups, weight, bias, float(eps)


def _instance_norm_args(ctx, node: fx.Node, shape: Tuple[int, ...]) -> Optional[Tuple[int, Any, Any, float]]:
    """An instance norm over its input's statistics as the group norm of one group a channel: (channels,
    weight, bias, eps), or None for one reading running statistics (a batch norm) or an unbatched input."""
    if node.op == "call_module":
        m = ctx.prepared.get_submodule(node.target)
        if (m.track_running_stats and not m.training) or len(shape) != m._get_no_batch_dim() + 1:
            return None
        found = (m.weight, m.bias, m.eps)
    else:
        args = canonical(node).args
        if args.get("use_input_stats", True) is not True:
            return None
        found = (_tensor(ctx, args.get("weight")), _tensor(ctx, args.get("bias")), args.get("eps", 1e-5))
    weight, bias, eps = found
    if len(shape) < 3 or _NO_TENSOR in (weight, bias) or not isinstance(eps, (int, float)):
        return None
    return shape[1], weight, bias, float(eps)


def lower_group_norm(ctx, members, resolve) -> Optional[QValue]:  # group_norm, instance_norm -> lucid_fx.group_norm
    node = members[0]
    source = resolve(canonical(node).args.get("input"))
    x = ctx.quant_or_none(source)
    if x is None or ctx.qparams_of(node) is None:
        return None
    if canonical(node).op == "instance_norm":
        found = _instance_norm_args(ctx, node, tuple(getattr(source.meta.get(_meta.TENSOR_META), "shape", ())))
    else:
        found = _group_norm_args(ctx, node)
    if found is None:
        return None
    groups, weight, bias, eps = found
    w, b = _constant(ctx, node, "weight", weight), _constant(ctx, node, "bias", bias)
    scale, zp, _ = ctx.qparams_of(node)
    out = ctx.call(_ops.group_norm, x.node, x.scale, x.zero_point, groups, w, b, eps, scale, zp)
    return ctx.output_qvalue(node, out, x.channels_last)


def _batch_norm_args(ctx, node: fx.Node) -> Optional[Tuple[Any, Any, Any, Any, float]]:
    """(running mean, running var, weight, bias, eps) of an eval-mode batch norm module or call over
    constants; None for one in training mode, without running statistics or over computed values."""
    if node.op == "call_module":
        m = ctx.prepared.get_submodule(node.target)
        if m.training or m.running_mean is None:
            return None
        found = (m.running_mean, m.running_var, m.weight, m.bias, m.eps)
    else:
        args = canonical(node).args
        if args.get("training", False) is not False:
            return None
        found = tuple(_tensor(ctx, args.get(k)) for k in ("running_mean", "running_var", "weight", "bias")) + (
            args.get("eps", 1e-5),)
    mean, var, _, _, eps = found
    if _NO_TENSOR in found[:4] or mean is None or var is None or not isinstance(eps, (int, float)):
        return None
    return found[:4] + (float(eps),)


def lower_batch_norm(ctx, members, resolve) -> Optional[QValue]:  # batch_norm no conv folds -> lucid_fx.channel_lut
    node = members[0]
    source = resolve(canonical(node).args.get("input"))
    x = ctx.quant_or_none(source)
    found = _batch_norm_args(ctx, node)
    if len(members) != 1 or x is None or found is None or ctx.qparams_of(node) is None:
        return None
    mean, var, weight, bias, eps = found
    scale, zp, qdtype = ctx.qparams_of(node)
    tables = batch_norm_tables(mean, var, weight, bias, eps, x.scale, x.zero_point, (x.qdtype.quant_min, x.qdtype.quant_max),
                               scale, zp, (qdtype.quant_min, qdtype.quant_max), qdtype.storage)
    out = ctx.call(_ops.channel_lut, x.node, ctx.constant(f"{node.name}_tables", tables), 1)
    return QValue(out, scale, zp, qdtype, x.channels_last)  # each code looked up where it lies: x's layout
