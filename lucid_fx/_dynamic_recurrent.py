"""What quantize_dynamic's recurrent layers and cells share (lucid_fx/dynamic_rnn.py): int8 weight buffers
per gate row, the input products of a batch, W_hh packed for the recurrence, the states the caller gives, and an
RNN's nonlinearity."""

from __future__ import annotations

import math
from typing import Any, Dict, Optional, Tuple

import torch
from torch import nn

from lucid_fx.kernels import recurrent
from lucid_fx.kernels.dynamic_linear import dynamic_linear
from lucid_fx.kernels.target import Target, resolve_target
from lucid_fx.quantization.qconfig import QConfig
from lucid_fx.quantization.weight import quantize_weight

__all__ = ["Recurrent", "Elman", "checked_nonlinearity"]


class Recurrent(nn.Module):
    """What the layers and the cells share: int8 weight buffers named ``weight_{ih,hh}_{codes,scale}<where>``
    and ``bias_{ih,hh}<where>``, the input products of a batch, and W_hh packed for the recurrence."""

    mode = ""  # "LSTM", "GRU", "RNN_TANH" or "RNN_RELU": recurrent.CELLS's key

    @staticmethod
    def _options(layer: nn.Module) -> Dict[str, Any]:
        """What the constructor takes from the float layer beyond its sizes (an RNN's nonlinearity)."""
        return {}

    def _register(self, shapes: Dict[str, Tuple[int, int]], bias: bool, weights) -> None:
        """``shapes``: (rows, columns) by ``ih<where>`` / ``hh<where>`` (and an LSTM's projection, ``hr<where>``, which
        has no bias); ``weights`` the buffers by name, or None for zeros of those shapes."""
        for key, (rows, columns) in shapes.items():
            kind, where = key[:2], key[2:]
            zeros = {f"weight_{kind}_codes{where}": torch.zeros(rows, columns, dtype=torch.int8),
                     f"weight_{kind}_scale{where}": torch.ones(rows)}
            if kind != "hr":
                zeros[f"bias_{kind}{where}"] = torch.zeros(rows) if bias else None
            for name, tensor in zeros.items():
                self.register_buffer(name, weights[name] if weights is not None else tensor)

    @staticmethod
    def _quantized(float_module: nn.Module, qconfig: QConfig, target: Optional[Target], sources) -> Dict[str, Any]:
        """The buffers of ``float_module``'s weights, ``sources`` as (kind, its suffix, where): per row with
        ``qconfig.weight``'s observer on the target's weight grid; rows of one ``where`` stacked in order."""
        if qconfig.activation_qdtype.bits != 8:
            raise ValueError(f"quantize_dynamic: activations are quantized to quint8 or qint8, the QConfig asks for "
                             f"{qconfig.activation_qdtype}")
        target = target or resolve_target(device=next(float_module.parameters()).device)
        weights: Dict[str, Any] = {}
        for kind, suffix, where in sources:
            codes, scale = quantize_weight(getattr(float_module, f"weight_{kind}{suffix}"), qconfig.weight(), target.weight_range)
            bias = getattr(float_module, f"bias_{kind}{suffix}").detach().float().clone() if float_module.bias and kind != "hr" else None
            for name, tensor in ((f"weight_{kind}_codes{where}", codes), (f"weight_{kind}_scale{where}", scale), (f"bias_{kind}{where}", bias)):
                weights[name] = tensor if name not in weights or tensor is None else torch.cat([weights[name], tensor])
        return weights

    def _weight(self, where: str, kind: str = "hh") -> recurrent.RecurrentWeight:
        """W_ih, W_hh or W_hr as the kernels take it (packed once per codes tensor, again after a load_state_dict wrote it)."""
        buffers = self._buffers  # not getattr: Module.__getattr__ cost 1.5 us a name, a tenth of a small cell's call
        return recurrent.recurrent_weight(buffers[f"weight_{kind}_codes{where}"], buffers[f"weight_{kind}_scale{where}"],
                                          buffers.get(f"bias_{kind}{where}"))

    def _gates(self, x: torch.Tensor, where: str) -> torch.Tensor:
        """x @ W_ih^T + b_ih of every row (and direction): one per-batch int8 GEMM, float out (rows, D * G * H)."""
        return dynamic_linear(x, self._weight(where, "ih"), self.activation_qdtype, type(self).__name__)

    def _checked(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.input_size:
            raise ValueError(f"{type(self).__name__}: input has {x.shape[-1]} features (last dim), the layer expects {self.input_size}")
        return x.to(torch.float32).contiguous()

    def _given(self, hx) -> Tuple[torch.Tensor, ...]:
        """The states the caller gave: (h,) or (h, c)."""
        lstm = self.mode == "LSTM"
        if lstm != isinstance(hx, (tuple, list)) or (lstm and len(hx) != 2):
            raise ValueError(f"{type(self).__name__}: hx must be {'a pair (h_0, c_0)' if lstm else 'one tensor h_0'}")
        return tuple(hx) if lstm else (hx,)

    def _largest(self, given: Tuple[torch.Tensor, ...]) -> float:
        """h's largest magnitude (its grid's bound), every state checked finite."""
        largest = [float(state.detach().abs().amax()) if state.numel() else 0.0 for state in given]
        if not all(map(math.isfinite, largest)):
            raise ValueError(f"{type(self).__name__}: the initial state holds inf or nan")
        return largest[0] if largest else 0.0


def checked_nonlinearity(value: str) -> str:
    if value not in ("tanh", "relu"):
        raise ValueError(f"nonlinearity must be 'tanh' or 'relu', got {value!r}")
    return value


class Elman:
    """What an RNN and its cell add: ``nonlinearity`` ("tanh": the state on [-1, 1] as an LSTM's; "relu": no bound,
    so each step's grid covers its state, max(1, |h|) in 127 steps a side)."""

    nonlinearity = "tanh"

    @property
    def mode(self) -> str:
        return "RNN_TANH" if self.nonlinearity == "tanh" else "RNN_RELU"

    @staticmethod
    def _options(layer: nn.Module) -> Dict[str, Any]:
        return {"nonlinearity": layer.nonlinearity}

    def extra_repr(self) -> str:
        return super().extra_repr() + ("" if self.nonlinearity == "tanh" else ", nonlinearity='relu'")
