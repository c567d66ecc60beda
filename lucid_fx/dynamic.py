"""quantize_dynamic: int8 Linear, LSTM, GRU and RNN layers whose activation qparams are computed per batch.

Weights are quantized once (per-channel symmetric int8 on the kernels' weight grid,
the Target's ``weight_range``, resolved once per call); each call measures the input's min/max, quantizes
it to uint8 (or int8) with those qparams, and runs the int8 GEMM ``torch.ops.lucid_fx.linear``
(oneDNN on CPU with the packed weight cached, ``torch._int_mm`` otherwise) straight to a float
result. No calibration: suited to layers whose input range varies from batch to batch. LSTM, GRU and RNN
layers become :class:`DynamicQuantizedLSTM` / :class:`DynamicQuantizedGRU` / :class:`DynamicQuantizedRNN`
(:mod:`lucid_fx.dynamic_rnn`), their cells the same.
"""

from __future__ import annotations

import copy
import functools
from typing import Any, Dict, Optional, Union

import torch
from torch import nn

from lucid_fx.dynamic_rnn import (RECURRENT_SWAPS, DynamicQuantizedGRU, DynamicQuantizedGRUCell, DynamicQuantizedLSTM,
                                  DynamicQuantizedLSTMCell, DynamicQuantizedRNN, DynamicQuantizedRNNCell)
from lucid_fx.kernels.dynamic_linear import dynamic_linear
from lucid_fx.kernels.recurrent import recurrent_weight
from lucid_fx.kernels.target import Target, resolve_target
from lucid_fx.quantization.weight import quantize_weight
from lucid_fx.quantization.dtypes import QDtype, qint8, to_qdtype
from lucid_fx.quantization.qconfig import QConfig, default_dynamic_qconfig

__all__ = ["quantize_dynamic", "DynamicQuantizedLinear", "DynamicQuantizedLSTM", "DynamicQuantizedGRU", "DynamicQuantizedRNN",
           "DynamicQuantizedLSTMCell", "DynamicQuantizedGRUCell", "DynamicQuantizedRNNCell", "SWAPS"]

_ops = torch.ops.lucid_fx


class DynamicQuantizedLinear(nn.Module):
    """``nn.Linear`` with int8 weights and per-batch int8 activations; float in, float out.

    Buffers: ``weight_codes`` (int8, out x in), ``weight_scale`` (float32, one per output
    channel, zero points 0) and ``bias`` (float32 or None). Build one with :meth:`from_float`.
    """

    def __init__(self, weight_codes: torch.Tensor, weight_scale: torch.Tensor, bias: Optional[torch.Tensor],
                 activation_qdtype: QDtype) -> None:
        super().__init__()
        self.out_features, self.in_features = weight_codes.shape
        self.activation_qdtype = activation_qdtype
        self.register_buffer("weight_codes", weight_codes)
        self.register_buffer("weight_scale", weight_scale)
        self.register_buffer("bias", bias)

    @classmethod
    def from_float(cls, linear: nn.Linear, qconfig: QConfig = default_dynamic_qconfig,
                   target: Optional[Target] = None) -> "DynamicQuantizedLinear":
        """Quantize ``linear``'s weight with ``qconfig.weight``'s observer on ``target``'s weight grid
        (default: the Target of the weight's device); activations get ``qconfig.activation``'s dtype
        (quint8 by default, or qint8)."""
        activation = qconfig.activation_qdtype
        if activation.bits != 8:
            raise ValueError(f"quantize_dynamic: activations are quantized to quint8 or qint8, the QConfig asks for {activation}")
        target = target or resolve_target(device=linear.weight.device)
        weight = linear.weight.t() if is_foreign_linear(type(linear)) else linear.weight  # Conv1D's is (in, out)
        codes, scale = quantize_weight(weight, qconfig.weight(), target.weight_range)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        return cls(codes, scale, bias, activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"DynamicQuantizedLinear: input has {x.shape[-1]} features (last dim), the layer expects {self.in_features}")
        if x.numel() == 0:
            return x.new_zeros((*x.shape[:-1], self.out_features))
        rows = x.reshape(-1, self.in_features)
        rows = rows if rows.dtype == torch.float32 and rows.is_contiguous() else rows.float().contiguous()
        buffers = self._buffers  # read straight: Module.__getattr__ costs 1.5 us a name
        weight = recurrent_weight(buffers["weight_codes"], buffers["weight_scale"], buffers["bias"])
        out = dynamic_linear(rows, weight, self.activation_qdtype, "DynamicQuantizedLinear")
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out if x.dtype == torch.float32 else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, activation={self.activation_qdtype.name}"


# The layers quantize_dynamic swaps, by exact type (a subclass, such as attention's out_proj, is read by its
# parent), and how each is built from the float one.
SWAPS = {nn.Linear: DynamicQuantizedLinear, **RECURRENT_SWAPS}
# Other libraries' layers that are linears, by (module, class name), so that lucid_fx imports none of them:
# transformers' Conv1D (GPT-2's projections: ``addmm(bias, x, weight)``, its weight stored (in, out)). They
# count as nn.Linear in qconfig_spec, and become a DynamicQuantizedLinear.
FOREIGN_LINEARS = frozenset({("transformers.pytorch_utils", "Conv1D")})
_SWAPPED = ", ".join(f"nn.{kind.__name__}" for kind in SWAPS) + " (and transformers' Conv1D)"


def is_foreign_linear(kind: type) -> bool:
    return (kind.__module__, kind.__qualname__) in FOREIGN_LINEARS


def _spec(qconfig_spec) -> Dict[Any, Optional[QConfig]]:
    if qconfig_spec is None:
        return {kind: default_dynamic_qconfig for kind in SWAPS}
    if isinstance(qconfig_spec, dict):
        spec = dict(qconfig_spec)
    elif isinstance(qconfig_spec, (set, frozenset, list, tuple)):
        spec = {key: default_dynamic_qconfig for key in qconfig_spec}
    else:
        raise ValueError(f"quantize_dynamic: qconfig_spec must be None, a set of types/names or a dict, got {type(qconfig_spec).__name__}")
    for key, qconfig in spec.items():
        if isinstance(key, type) and key not in SWAPS and not is_foreign_linear(key):
            raise ValueError(
                f"quantize_dynamic quantizes {_SWAPPED}; {key.__name__} in qconfig_spec is not supported "
                "(to quantize the layers inside a module, give its qualified name)"
            )
        if not isinstance(key, (type, str)):
            raise ValueError(f"quantize_dynamic: qconfig_spec keys are {_SWAPPED} or module names, got {key!r}")
        if qconfig is not None and not isinstance(qconfig, QConfig):
            raise ValueError(f"quantize_dynamic: qconfig_spec[{key!r}] must be a QConfig or None, got {type(qconfig).__name__}")
    return spec


def _swap(module: nn.Module, name: str, inherited: Optional[QConfig], spec: Dict[Any, Optional[QConfig]], targets) -> nn.Module:
    # Lookup order of the reference framework: the parent's qconfig, then the exact type, then the name.
    foreign = is_foreign_linear(type(module))
    qconfig = spec.get(type(module), spec.get(nn.Linear, inherited) if foreign else inherited)
    qconfig = spec.get(name, qconfig)
    swap = DynamicQuantizedLinear if foreign else SWAPS.get(type(module))
    if swap is not None and qconfig is not None:
        return swap.from_float(module, qconfig, targets(next(module.parameters()).device))
    if swap is not None:
        return module
    for child_name, child in list(module.named_children()):
        new = _swap(child, f"{name}.{child_name}" if name else child_name, qconfig, spec, targets)
        if new is not child:
            setattr(module, child_name, new)
    return module


def quantize_dynamic(
    model: nn.Module,
    qconfig_spec: Union[None, set, dict] = None,
    dtype: Union[torch.dtype, QDtype, str] = qint8,
    inplace: bool = False,
) -> nn.Module:
    """Replace ``nn.Linear`` layers (and transformers' ``Conv1D``: :data:`FOREIGN_LINEARS`) with
    :class:`DynamicQuantizedLinear` (int8 weights, per-batch int8 activations, float outputs), ``nn.LSTM``, ``nn.GRU``, ``nn.RNN`` and their cells with
    :class:`DynamicQuantizedLSTM`, :class:`DynamicQuantizedGRU`, ... (int8 weights and products, float cells). No
    calibration is needed.

    Args:
        model: the float model.
        qconfig_spec: which layers: None (every layer of :data:`SWAPS`' types), a set of
            those types and/or qualified module names (a name covers the layers inside it), or a
            dict from those to a QConfig (``None`` keeps that part float). The QConfig's weight observer sets
            the weight codes and its activation dtype (:data:`default_dynamic_qconfig`: quint8)
            the activation grid.
        dtype: the weight dtype; only ``qint8`` (also ``torch.qint8``).
        inplace: swap layers in ``model`` itself (a root that is itself such a layer is returned
            swapped either way).

    Returns:
        The model with dynamically quantized layers.

    Example:
        >>> import torch
        >>> from torch import nn
        >>> import lucid_fx.quantization as Q
        >>> model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        >>> qmodel = Q.quantize_dynamic(model, {"0"})
        >>> [type(m).__name__ for m in qmodel]
        ['DynamicQuantizedLinear', 'ReLU', 'Linear']
        >>> x = torch.randn(8, 16)
        >>> bool((qmodel(x) - model(x)).abs().max() < 0.05)
        True
    """
    try:
        weight_dtype = to_qdtype(dtype)
    except ValueError:
        weight_dtype = None
    if weight_dtype != qint8:
        raise ValueError(f"quantize_dynamic: weights are quantized to qint8; dtype={dtype} is not supported")
    spec = _spec(qconfig_spec)
    known = {name for name, _ in model.named_modules()}
    missing = [key for key in spec if isinstance(key, str) and key not in known]
    if missing:
        raise ValueError(f"quantize_dynamic: {type(model).__name__} has no submodule(s) {', '.join(map(repr, missing))} named in qconfig_spec")
    work = model if inplace else copy.deepcopy(model)
    with torch.no_grad():
        # One Target per device the weights are on, resolved once for the whole model.
        targets = functools.lru_cache(maxsize=None)(lambda device: resolve_target(device=device))
        return _swap(work, "", None, spec, targets)
