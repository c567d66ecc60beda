"""DynamicQuantizedLSTM, DynamicQuantizedGRU and DynamicQuantizedRNN (and their cells): ``nn.LSTM``, ``nn.GRU``,
``nn.RNN`` (tanh or relu), ``nn.LSTMCell``, ``nn.GRUCell`` and ``nn.RNNCell`` with int8 weights, for quantize_dynamic.

Per layer, the input-to-hidden products of every step (and both directions) are one int8 GEMM on the
sequence's own range (``DynamicQuantizedLinear``'s per-batch qparams); the hidden-to-hidden products
run step by step in int8 on a fixed grid for the state (a relu RNN's: each step's own), the cells in float32
(:mod:`lucid_fx.kernels.recurrent`: the whole sequence of a layer and direction in one native call).
Weights are quantized once, per gate row, on the Target's weight grid. Float in, float out; inference
only (dropout between layers is not applied, as in eval mode). Inputs as torch takes them: (T, B, I),
``batch_first`` (B, T, I), unbatched (T, I), or a ``PackedSequence``; states as torch's. A cell is one
step of the same: its state is the caller's, so its grid covers the state it is given.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from torch import nn
from torch.nn.utils.rnn import PackedSequence

from lucid_fx._dynamic_recurrent import Elman, Recurrent, checked_nonlinearity
from lucid_fx.kernels import recurrent
from lucid_fx.kernels.target import Target
from lucid_fx.quantization.dtypes import QDtype
from lucid_fx.quantization.qconfig import QConfig, default_dynamic_qconfig

__all__ = ["DynamicQuantizedLSTM", "DynamicQuantizedGRU", "DynamicQuantizedRNN", "DynamicQuantizedLSTMCell", "DynamicQuantizedGRUCell",
           "DynamicQuantizedRNNCell", "RECURRENT_SWAPS"]


class _DynamicQuantizedRNN(Recurrent):
    proj_size = 0  # an LSTM's projection (DynamicQuantizedLSTM sets it)

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, bidirectional: bool = False, activation_qdtype: Optional[QDtype] = None,
                 weights: Optional[Dict[str, Optional[torch.Tensor]]] = None) -> None:
        """``weights``: the buffers by name (:meth:`from_float` builds them), zeros of their shapes if None. Per
        layer, ``weight_ih_codes_l0`` (int8), ``weight_ih_scale_l0`` (float32, per row) and ``bias_ih_l0`` hold
        both directions' input weights, one after the other; ``weight_hh_codes_l0``, ``weight_hh_scale_l0``,
        ``bias_hh_l0`` the hidden weights of the forward direction, the same names ending ``_reverse`` the other's (an
        LSTM's projection: ``weight_hr_codes_l0``, ``weight_hr_scale_l0``, no bias)."""
        super().__init__()
        self.input_size, self.hidden_size, self.num_layers = input_size, hidden_size, num_layers
        self.bias, self.batch_first, self.bidirectional = bias, batch_first, bidirectional
        self.activation_qdtype = activation_qdtype or default_dynamic_qconfig.activation_qdtype
        directions, gates, state = 2 if bidirectional else 1, recurrent.CELLS[self.mode] * hidden_size, self._state_size()
        shapes = {}
        for layer in range(num_layers):
            shapes[f"ih_l{layer}"] = (directions * gates, input_size if layer == 0 else state * directions)
            for suffix in ("", "_reverse")[:directions]:
                shapes[f"hh_l{layer}{suffix}"] = (gates, state)
                if self.proj_size:
                    shapes[f"hr_l{layer}{suffix}"] = (self.proj_size, hidden_size)
        self._register(shapes, bias, weights)

    def _state_size(self) -> int:
        """The size of h (and of each direction's output): the projection's, else hidden_size."""
        return self.proj_size or self.hidden_size

    @classmethod
    def from_float(cls, rnn: nn.Module, qconfig: QConfig = default_dynamic_qconfig, target: Optional[Target] = None):
        """Quantize ``rnn``'s weights (an ``nn.LSTM`` for DynamicQuantizedLSTM, its ``proj_size`` kept, an ``nn.GRU``
        for DynamicQuantizedGRU, an ``nn.RNN`` for DynamicQuantizedRNN) per row with ``qconfig.weight``'s observer on
        ``target``'s weight grid."""
        suffixes = ("", "_reverse")[:2 if rnn.bidirectional else 1]
        kinds = ("ih", "hh", "hr") if getattr(rnn, "proj_size", 0) else ("ih", "hh")
        sources = [(kind, f"_l{layer}{s}", f"_l{layer}" if kind == "ih" else f"_l{layer}{s}")
                   for layer in range(rnn.num_layers) for kind in kinds for s in suffixes]
        weights = cls._quantized(rnn, qconfig, target, sources)
        return cls(rnn.input_size, rnn.hidden_size, rnn.num_layers, rnn.bias, rnn.batch_first, rnn.bidirectional,
                   qconfig.activation_qdtype, weights, **cls._options(rnn))

    def forward(self, input, hx=None):
        packed = isinstance(input, PackedSequence)
        x, rows, batch, sequence = self._steps(input)
        unbatched = not packed and input.dim() == 2
        states = self._states(hx, batch, input.sorted_indices if packed else None, unbatched)
        directions, hidden, size = 2 if self.bidirectional else 1, self.hidden_size, self._state_size()
        gates = recurrent.CELLS[self.mode] * hidden
        finals = []
        for layer in range(self.num_layers):
            gx = self._gates(x, f"_l{layer}")
            out = torch.empty(x.shape[0], directions * size, dtype=torch.float32, device=x.device)
            for direction in range(directions):
                index, where = layer * directions + direction, f"_l{layer}{'_reverse' if direction else ''}"
                h0 = None if states is None else states[0][index]
                h = torch.zeros(batch, size, device=x.device) if h0 is None else h0.to(torch.float32).contiguous().clone()
                c = None if self.mode != "LSTM" else torch.zeros(batch, hidden, device=x.device) if h0 is None else \
                    states[1][index].to(torch.float32).contiguous().clone()
                recurrent.run_layer(self.mode, gx[:, direction * gates:(direction + 1) * gates], self._weight(where),
                                    h, c, out[:, direction * size:(direction + 1) * size], rows, direction == 1,
                                    recurrent.state_grid(h0), self._weight(where, "hr") if self.proj_size else None)
                finals.append((h, c))
            x = out
        return self._outputs(input, x, finals, sequence, unbatched)

    def _steps(self, input):
        """(rows of the steps' inputs (float32, 2-d), the steps' row offsets, batch, (T, B) or None if packed)."""
        if isinstance(input, PackedSequence):
            sizes = [int(b) for b in input.batch_sizes]
            rows = [0]
            for size in sizes:
                rows.append(rows[-1] + size)
            return self._checked(input.data), rows, sizes[0], None
        if input.dim() not in (2, 3):
            raise ValueError(f"{type(self).__name__}: expects an input of 2 (unbatched) or 3 dims, got shape {tuple(input.shape)}")
        x = input.unsqueeze(1) if input.dim() == 2 else (input.transpose(0, 1) if self.batch_first else input)
        steps, batch = x.shape[:2]
        return self._checked(x.reshape(steps * batch, x.shape[-1])), [t * batch for t in range(steps + 1)], batch, (steps, batch)

    def _states(self, hx, batch: int, sorted_indices, unbatched: bool):
        """(h0,) or (h0, c0), each (layers * directions, batch, hidden: h0's the projection's if any) in the steps'
        order of rows; None for zeros."""
        if hx is None:
            return None
        states, given = [], self._given(hx)
        self._largest(given)
        for state, size in zip(given, (self._state_size(), self.hidden_size)):
            shape = (self.num_layers * (2 if self.bidirectional else 1), batch, size)
            state = state.unsqueeze(1) if unbatched and state.dim() == 2 else state
            if tuple(state.shape) != shape:
                raise ValueError(f"{type(self).__name__}: expected a hidden state of shape {shape}, got {tuple(state.shape)}")
            states.append(state if sorted_indices is None else state.index_select(1, sorted_indices))
        return tuple(states)

    def _outputs(self, input, out: torch.Tensor, finals, sequence, unbatched: bool):
        dtype = input.data.dtype if isinstance(input, PackedSequence) else input.dtype
        h_n = torch.stack([h for h, _ in finals]).to(dtype)
        c_n = torch.stack([c for _, c in finals]).to(dtype) if self.mode == "LSTM" else None
        if sequence is None:  # packed: the final states back in the caller's order of sequences
            if input.unsorted_indices is not None:
                h_n, c_n = (None if s is None else s.index_select(1, input.unsorted_indices) for s in (h_n, c_n))
            output = PackedSequence(out.to(dtype), input.batch_sizes, input.sorted_indices, input.unsorted_indices)
        else:
            output = out.view(*sequence, out.shape[-1]).to(dtype)
            if unbatched:
                output, h_n, c_n = output.squeeze(1), h_n.squeeze(1), None if c_n is None else c_n.squeeze(1)
            elif self.batch_first:
                output = output.transpose(0, 1)
        return (output, (h_n, c_n)) if self.mode == "LSTM" else (output, h_n)

    def extra_repr(self) -> str:
        extras = "".join(f", {name}={getattr(self, name)}" for name in ("num_layers", "bias", "batch_first", "bidirectional", "proj_size")
                         if getattr(self, name) != {"num_layers": 1, "bias": True, "proj_size": 0}.get(name, False))
        return f"{self.input_size}, {self.hidden_size}{extras}, activation={self.activation_qdtype.name}"


class DynamicQuantizedLSTM(_DynamicQuantizedRNN):
    """``nn.LSTM`` with int8 weights: per-batch int8 inputs, an int8 state on [-1, 1], float cells; float
    in, float out (:mod:`lucid_fx.dynamic_rnn`). Build one with :meth:`from_float`. With ``proj_size``, h = W_hr
    (o * tanh(c)) in int8 too (o * tanh(c) on the grid of [-1, 1]), h on each step's own grid: no fixed bound."""

    mode = "LSTM"

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, bidirectional: bool = False, activation_qdtype: Optional[QDtype] = None,
                 weights: Optional[Dict[str, Optional[torch.Tensor]]] = None, proj_size: int = 0) -> None:
        if not 0 <= proj_size < hidden_size:
            raise ValueError(f"proj_size must be in [0, hidden_size), got {proj_size} with hidden_size {hidden_size}")
        self.proj_size = proj_size  # the base reads it
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, bidirectional, activation_qdtype, weights)

    @staticmethod
    def _options(layer: nn.Module) -> Dict[str, Any]:
        return {"proj_size": layer.proj_size}


class DynamicQuantizedGRU(_DynamicQuantizedRNN):
    """``nn.GRU`` with int8 weights, as :class:`DynamicQuantizedLSTM`."""

    mode = "GRU"


class DynamicQuantizedRNN(Elman, _DynamicQuantizedRNN):
    """``nn.RNN`` (tanh or relu) with int8 weights, as :class:`DynamicQuantizedLSTM`."""

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, bidirectional: bool = False, activation_qdtype: Optional[QDtype] = None,
                 weights: Optional[Dict[str, Optional[torch.Tensor]]] = None, nonlinearity: str = "tanh") -> None:
        self.nonlinearity = checked_nonlinearity(nonlinearity)  # the base reads mode
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, bidirectional, activation_qdtype, weights)


class _DynamicQuantizedCell(Recurrent):
    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, activation_qdtype: Optional[QDtype] = None,
                 weights: Optional[Dict[str, Optional[torch.Tensor]]] = None) -> None:
        """``weights``: ``weight_ih_codes``, ``weight_ih_scale``, ``bias_ih`` and the same for ``hh``."""
        super().__init__()
        self.input_size, self.hidden_size, self.bias = input_size, hidden_size, bias
        self.activation_qdtype = activation_qdtype or default_dynamic_qconfig.activation_qdtype
        gates = recurrent.CELLS[self.mode] * hidden_size
        self._register({"ih": (gates, input_size), "hh": (gates, hidden_size)}, bias, weights)

    @classmethod
    def from_float(cls, cell: nn.Module, qconfig: QConfig = default_dynamic_qconfig, target: Optional[Target] = None):
        """Quantize ``cell``'s weights (an ``nn.LSTMCell``, ``nn.GRUCell`` or ``nn.RNNCell``) as the layers' are."""
        weights = cls._quantized(cell, qconfig, target, [("ih", "", ""), ("hh", "", "")])
        return cls(cell.input_size, cell.hidden_size, cell.bias, qconfig.activation_qdtype, weights, **cls._options(cell))

    def forward(self, input: torch.Tensor, hx=None):
        if input.dim() not in (1, 2):
            raise ValueError(f"{type(self).__name__}: expects an input of 1 (unbatched) or 2 dims, got shape {tuple(input.shape)}")
        x = self._checked(input.reshape(-1, input.shape[-1]))
        batch, hidden, name = x.shape[0], self.hidden_size, type(self).__name__
        given = self._given(hx) if hx is not None else ()
        states = [torch.zeros(batch, hidden, device=x.device)] * (2 if self.mode == "LSTM" else 1) if hx is None else \
            [s.reshape(-1, hidden) if s.dim() == input.dim() else s for s in given]
        for state in states:
            if tuple(state.shape) != (batch, hidden):
                raise ValueError(f"{name}: expected a hidden state of shape {(batch, hidden)}, got {tuple(state.shape)}")
        h, c = (_own_float32(s) for s in states) if self.mode == "LSTM" else (_own_float32(states[0]), None)
        # one native call where it takes them (the grid's bound read from float32 states, as given)
        if not (all(s.dtype == torch.float32 for s in given)
                and recurrent.run_cell(self.mode, x, self._weight("", "ih"), self._weight(""), h, c, self.activation_qdtype, name)):
            largest = self._largest(given)
            recurrent.run_layer(self.mode, self._gates(x, ""), self._weight(""), h, c, torch.empty(batch, hidden, device=x.device),
                                [0, batch], False, recurrent.state_grid(None, largest))
        h, c = (None if s is None else (s if s.dtype == input.dtype else s.to(input.dtype)).view(*input.shape[:-1], hidden)
                for s in (h, c))
        return (h, c) if self.mode == "LSTM" else h

    def extra_repr(self) -> str:
        return f"{self.input_size}, {self.hidden_size}{'' if self.bias else ', bias=False'}, activation={self.activation_qdtype.name}"


def _own_float32(state: torch.Tensor) -> torch.Tensor:
    """A dense float32 copy of ``state`` the call may write (a no-op .to costs 1.5 us: kernels/native.py)."""
    if state.dtype == torch.float32 and state.is_contiguous():
        return state.clone()
    return state.to(torch.float32).contiguous().clone()


class DynamicQuantizedLSTMCell(_DynamicQuantizedCell):
    """``nn.LSTMCell`` with int8 weights: one step of :class:`DynamicQuantizedLSTM`, the state's grid
    covering the state given (at least [-1, 1])."""

    mode = "LSTM"


class DynamicQuantizedGRUCell(_DynamicQuantizedCell):
    """``nn.GRUCell`` with int8 weights, as :class:`DynamicQuantizedLSTMCell`."""

    mode = "GRU"


class DynamicQuantizedRNNCell(Elman, _DynamicQuantizedCell):
    """``nn.RNNCell`` (tanh or relu) with int8 weights, as :class:`DynamicQuantizedLSTMCell`."""

    def __init__(self, input_size: int, hidden_size: int, bias: bool = True, activation_qdtype: Optional[QDtype] = None,
                 weights: Optional[Dict[str, Optional[torch.Tensor]]] = None, nonlinearity: str = "tanh") -> None:
        self.nonlinearity = checked_nonlinearity(nonlinearity)  # the base reads mode
        super().__init__(input_size, hidden_size, bias, activation_qdtype, weights)


# The float layer each of these replaces, by exact type: quantize_dynamic's and convert's (passes/lower_recurrent.py).
RECURRENT_SWAPS = {nn.LSTM: DynamicQuantizedLSTM, nn.GRU: DynamicQuantizedGRU, nn.RNN: DynamicQuantizedRNN,
                   nn.LSTMCell: DynamicQuantizedLSTMCell, nn.GRUCell: DynamicQuantizedGRUCell, nn.RNNCell: DynamicQuantizedRNNCell}
