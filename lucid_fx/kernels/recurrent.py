"""Recurrent layers (LSTM, GRU, RNN with tanh or relu) whose hidden-to-hidden products run in int8: one layer
and direction over a whole sequence.

The input-to-hidden products of every step are one int8 GEMM the caller runs first (``gx``: x @ W_ih^T +
b_ih for all steps, float); what is left is a chain of small steps, each reading the state the one before
wrote. Each step quantizes the state's active rows to uint8 on a grid fixed for the sequence
(:func:`state_grid`: an LSTM's state is o * tanh(c), a GRU's a mix of tanh and the state before, a tanh RNN's
a tanh, so they stay in [-1, 1] once they start there; no per-step range, which would cost a reduction and a
sync a step; a relu RNN's state has no bound, so its grid is each step's, max(1, |h|), and a projected LSTM's
h each step's :func:`tight_grid`), multiplies them with the int8 weight (per-channel scales, b_hh added) into
float gates and runs the cell in float32 with torch's formulas (native_rnn.c has them).

Two routes, the same steps: ``native_rnn.c`` runs the whole sequence in one call where the native
kernels are loaded and their GEMM takes the weight (:func:`lucid_fx.kernels.linear_native.takes_weight`);
elsewhere (another device, ``LUCID_FX_NATIVE=0``) torch ops run each step (``torch.ops.lucid_fx.linear``,
torch.sigmoid and tanh). Their sigmoid and tanh differ by up to 2e-7, so a state code can differ where a
value lies that close to a rounding tie: tests/kernels/test_recurrent.py compares the two routes and
each with exact integer arithmetic.

Measured on AVX512-VNNI (EPYC, 1 thread), benchmarks/dynamic_rnn.py's token-by-token LSTM (T=64, B=1,
H=128): 0.33 ms a sequence, where a first version calling torch ops a step took 5.0 ms (fp32 0.56, torch.ao
1.21; docs/benchmarks.md, "Dynamic int8 LSTM and GRU").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Tuple

import torch

from lucid_fx.kernels import linear_native, program_ops
from lucid_fx.kernels.library import WeightCache
from lucid_fx.kernels.linear_row import small_gemm
from lucid_fx.kernels.native import _function
from lucid_fx.quantization.dtypes import QDtype

__all__ = ["CELLS", "RecurrentWeight", "recurrent_weight", "state_grid", "run_layer", "run_cell", "STATE_ZP"]

CELLS = {"LSTM": 4, "GRU": 3, "RNN_TANH": 1, "RNN_RELU": 1}  # gates per hidden unit, torch's order: i, f, g, o and r, z, n
_CELL_CODES = {cell: code for code, cell in enumerate(CELLS)}  # native_rnn.c's
STATE_ZP = 128  # the state's grid is symmetric: uint8 codes, zero point 128, [-128, 127] steps


@dataclass(frozen=True)
class RecurrentWeight:
    """W_hh (or W_ih) of one layer and direction: int8 codes (gates * hidden, inputs), per-row scales, the bias,
    and for the native route its packed blocks with the state's zero-point offsets (None where it does not take
    them; a W_ih's offsets follow each call's zero point: :func:`lucid_fx.kernels.dynamic_linear.dynamic_linear`)."""

    codes: torch.Tensor
    scale: torch.Tensor
    bias: Optional[torch.Tensor]
    packed: Optional[linear_native.PackedWeight]
    offset: Optional[torch.Tensor]  # int32: -STATE_ZP * row sums
    by_zp: Dict[int, torch.Tensor] = field(default_factory=dict)  # an input's offsets, -zp * row sums, by its zero point

    def offsets(self, zp: int) -> torch.Tensor:
        """-zp * row sums (int32), made once per zero point (a per-batch range has at most 256)."""
        found = self.by_zp.get(zp)
        if found is None:
            found = self.by_zp[zp] = self.packed.row_sums * -zp
        return found


def recurrent_weight(codes: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor]) -> RecurrentWeight:
    """The weight as both routes take it. The native route's blocks are built once per codes tensor (again after
    an in-place change: :class:`lucid_fx.kernels.library.WeightCache`), kept with the kernels, not the module."""
    packed, offset, by_zp = _PACKED.get(codes, ("recurrent", linear_native.full_grid()), lambda: _packed(codes))
    return RecurrentWeight(codes, _dense32(scale), None if bias is None else _dense32(bias), packed, offset, by_zp)


def _dense32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()


_PACKED = WeightCache()


def _packed(codes: torch.Tensor) -> Tuple[Optional[linear_native.PackedWeight], Optional[torch.Tensor], Dict[int, torch.Tensor]]:
    """The native GEMM's blocks, the state's zero-point offsets and room for an input's (by zero point), or
    (None, None, {}) where it does not take them."""
    if not (codes.is_cpu and linear_native.takes_weight(codes)):
        return None, None, {}
    packed = linear_native.packed_weight(codes)
    return packed, packed.row_sums * -STATE_ZP, {}


def state_grid(h0: Optional[torch.Tensor], largest: Optional[float] = None) -> Tuple[float, float]:
    """(scale, 1 / scale rounded to float32) of the state's codes: a bound of max(1, |h0|) in 127 steps
    each side, so a state that starts inside [-1, 1] (zeros by default) keeps the grid of [-1, 1].
    ``largest``: h0's largest magnitude where the caller has it already."""
    if largest is None:
        largest = 0.0 if h0 is None or h0.numel() == 0 else float(h0.detach().abs().amax())
    bound = max(1.0, largest)
    return _UNIT_GRID if bound == 1.0 else (bound / 127, float(torch.tensor(127 / bound, dtype=torch.float32)))


_UNIT_GRID = (1 / 127, 127.0)  # the grid of [-1, 1] (127 is a float32)


def tight_grid(t: torch.Tensor) -> Tuple[float, float]:
    """``state_grid`` without its floor of 1: ``t``'s largest magnitude in 127 steps a side (1 for all zeros), for
    a projected LSTM's values (o * tanh(c) and h), which have no fixed bound and often lie far inside [-1, 1]."""
    largest = float(t.abs().amax()) if t.numel() else 0.0
    bound = largest if largest > 0 else 1.0
    return bound / 127, float(torch.tensor(127 / bound, dtype=torch.float32))


def run_layer(cell: str, gx: torch.Tensor, weight: RecurrentWeight, h: torch.Tensor, c: Optional[torch.Tensor],
              out: torch.Tensor, rows: Sequence[int], reverse: bool, grid: Tuple[float, float],
              proj: Optional[RecurrentWeight] = None) -> None:
    """Run ``cell`` over the steps of ``gx`` (rows of gates, float32, a row stride of its own), writing each
    step's state into ``out``'s rows and updating ``h`` (and an LSTM's ``c``), (batch, hidden), in place.
    Step t owns rows ``rows[t]`` to ``rows[t + 1]`` of gx and out and the state's first rows (a packed
    sequence's batch shrinks with time); ``reverse`` runs the steps last to first. ``proj``: an LSTM's W_hr
    (proj_size): h = W_hr (o * tanh(c)), (batch, proj_size); h and o * tanh(c) each on the step's
    :func:`tight_grid`."""
    fn = _function("rnn", torch.float32)
    if fn is not None and weight.packed is not None and (proj is None or proj.packed is not None) \
            and _native_layout(gx, h, c, out):
        _run_native(fn, cell, gx, weight, h, c, out, rows, reverse, grid, proj)
        return
    steps = range(len(rows) - 2, -1, -1) if reverse else range(len(rows) - 1)
    scale, inv = grid
    for t in steps:
        first, batch = rows[t], rows[t + 1] - rows[t]
        if cell == "RNN_RELU" or proj is not None:  # no bound: each step's grid covers its state
            scale, inv = state_grid(h[:batch]) if proj is None else tight_grid(h[:batch])
        codes = program_ops.quantize_codes(h[:batch], inv, STATE_ZP, 0, 255, torch.uint8)
        gh = torch.ops.lucid_fx.linear(codes, scale, STATE_ZP, weight.codes, weight.scale, weight.bias, 1.0, 0,
                                       "none", torch.float32)
        full = h[:batch] if proj is None else torch.empty(batch, c.shape[1], device=h.device)  # o * tanh(c)
        _cell_step(cell, gh, gx[first:first + batch], full, None if c is None else c[:batch])
        if proj is not None:
            full_scale, full_inv = tight_grid(full)
            codes = program_ops.quantize_codes(full, full_inv, STATE_ZP, 0, 255, torch.uint8)
            h[:batch] = torch.ops.lucid_fx.linear(codes, full_scale, STATE_ZP, proj.codes, proj.scale, None, 1.0, 0,
                                                  "none", torch.float32)
        out[first:first + batch] = h[:batch]


def run_cell(cell: str, x: torch.Tensor, w_ih: RecurrentWeight, w_hh: RecurrentWeight, h: torch.Tensor,
             c: Optional[torch.Tensor], grid: QDtype, who: str) -> bool:
    """One call of a cell in one native call (native_rnn.c's ``lucid_cell_float32``): :func:`~lucid_fx.kernels.dynamic_linear.dynamic_linear` of ``x``
    and one step of :func:`run_layer` on ``state_grid``'s grid of ``h``, the same values, updating ``h`` and ``c``
    in place (float32, dense, (batch, hidden)); ``x`` float32, dense rows. False (nothing done) where the native
    route does not take them: the caller runs those two then. benchmarks/dynamic_rnn.py's decoder loops (AVX512-VNNI
    EPYC, 1 thread): 20 GRUCell (1, 128 -> 256) calls 2.28 -> 0.93 ms, LSTMCell (8, 256 -> 512) 5.23 -> 4.16 ms."""
    fn = _function("cell", torch.float32)
    (m, k), n = x.shape, w_ih.codes.shape[0]
    if (fn is None or w_ih.packed is None or w_hh.packed is None or grid.storage != torch.uint8 or not x.is_cpu
            or _function("gemm", torch.float32) is None or not small_gemm(m, n, k, "native")):
        return False
    batch, hidden = h.shape
    work = torch.empty(_cell_work(batch, k, hidden, n), dtype=torch.uint8)
    pointers = [None if t is None else t.data_ptr() for t in (w_ih.bias, w_hh.bias, c)]
    status = fn(x.data_ptr(), w_ih.packed.packed.data_ptr(), w_ih.packed.row_sums.data_ptr(), w_ih.scale.data_ptr(),
                pointers[0], w_hh.packed.packed.data_ptr(), w_hh.offset.data_ptr(), w_hh.scale.data_ptr(), pointers[1],
                h.data_ptr(), pointers[2], work.data_ptr(), _cell_geometry(batch, k, hidden, cell, grid.quant_min, grid.quant_max).data_ptr())
    if status:
        raise ValueError(f"{who}: the input holds inf or nan; a per-batch range needs finite values" if status == 1
                         else f"{who}: the initial state holds inf or nan")
    return True


def _cell_work(batch: int, inputs: int, hidden: int, gates: int) -> int:
    """The scratch bytes lucid_cell_float32 carves: gx and gh (float, batch x gates), the step's out (float),
    W_ih's offsets (int32, gates), the input's and the state's codes, each rounded up to 64 bytes."""
    block = lambda size: -(-size // 64) * 64  # noqa: E731
    return 2 * block(4 * batch * gates) + block(4 * batch * hidden) + block(4 * gates) + block(batch * inputs) + block(batch * hidden)


@functools.lru_cache(maxsize=256)
def _cell_geometry(batch: int, inputs: int, hidden: int, cell: str, qmin: int, qmax: int) -> torch.Tensor:
    """The call's geometry (int64), made once per shape (read only: torch.tensor costs 6 us a call)."""
    return torch.tensor([batch, inputs, hidden, _CELL_CODES[cell], qmin, qmax], dtype=torch.int64)


def _cell_step(cell: str, gh: torch.Tensor, gx: torch.Tensor, h: torch.Tensor, c: Optional[torch.Tensor]) -> None:
    """One step of torch's cell formulas on the step's gates, in place on the state's rows."""
    if cell in ("RNN_TANH", "RNN_RELU"):
        v = gh.add_(gx)
        h.copy_(v.tanh_() if cell == "RNN_TANH" else v.relu_())
        return
    if cell == "LSTM":
        i, f, g, o = gh.add_(gx).chunk(4, 1)
        cy = torch.addcmul(f.sigmoid_() * c, i.sigmoid_(), g.tanh_())
        c.copy_(cy)
        h.copy_(o.sigmoid_() * cy.tanh_())
        return
    (hr, hz, hn), (xr, xz, xn) = gh.chunk(3, 1), gx.chunk(3, 1)
    r, z = hr.add_(xr).sigmoid_(), hz.add_(xz).sigmoid_()
    n = torch.addcmul(xn, r, hn).tanh_()
    h.copy_(h.sub(n).mul_(z).add_(n))


def _native_layout(gx: torch.Tensor, h: torch.Tensor, c: Optional[torch.Tensor], out: torch.Tensor) -> bool:
    dense = all(t.dtype == torch.float32 and t.is_cpu and t.is_contiguous() for t in (h,) + (() if c is None else (c,)))
    rows_of = lambda t: t.dtype == torch.float32 and t.is_cpu and t.dim() == 2 and t.stride(1) == 1  # noqa: E731
    return dense and rows_of(gx) and rows_of(out)


def _run_native(fn, cell: str, gx: torch.Tensor, weight: RecurrentWeight, h: torch.Tensor, c: Optional[torch.Tensor],
                out: torch.Tensor, rows: Sequence[int], reverse: bool, grid: Tuple[float, float],
                proj: Optional[RecurrentWeight]) -> None:
    batch, state = h.shape
    hidden = state if c is None else c.shape[1]  # a projected LSTM's state is smaller than its cell
    geometry = torch.tensor([len(rows) - 1, batch, hidden, _CELL_CODES[cell], int(reverse), gx.stride(0),
                             out.stride(0), 0 if proj is None else state, *rows], dtype=torch.int64)
    codes = torch.empty(batch * max(state, hidden), dtype=torch.uint8)
    gh = torch.empty(batch * CELLS[cell] * hidden, dtype=torch.float32)
    bias = None if weight.bias is None else weight.bias.data_ptr()
    scratch = None if proj is None else torch.empty(2 * batch * hidden)  # o * tanh(c), kept alive through the call
    projection = (None,) * 4 if proj is None else (proj.packed.packed.data_ptr(), proj.offset.data_ptr(), proj.scale.data_ptr(),
                                                   scratch.data_ptr())
    fn(gx.data_ptr(), weight.packed.packed.data_ptr(), weight.offset.data_ptr(), weight.scale.data_ptr(), bias,
       h.data_ptr(), None if c is None else c.data_ptr(), out.data_ptr(), codes.data_ptr(), gh.data_ptr(),
       geometry.data_ptr(), grid[0], grid[1], *projection)
