"""lucid_fx/kernels/recurrent.py and native_rnn.c: a recurrent layer's steps in one native call against
exact integer products and float64 cells, on this CPU's build, without VNNI and portable; the torch
route against the same; the native sigmoid and tanh against torch's; a packed sequence's shrinking batch."""

import pytest
import torch

from lucid_fx.kernels import dynamic_linear, recurrent, weight_quant_range

H = 24


def _weight(cell: str, seed: int, bound: int = 63):
    """Codes in [-bound, bound]: 63 fits every CPU's grid and the native GEMM's int16 pair sums without VNNI."""
    g = torch.Generator().manual_seed(seed)
    gates = recurrent.CELLS[cell] * H
    codes = torch.randint(-bound, bound + 1, (gates, H), generator=g, dtype=torch.int8)
    return codes, torch.rand(gates, generator=g) * 0.02 + 0.01, torch.randn(gates, generator=g) * 0.3


def _exact(cell: str, gx, codes, scale, bias, h, c, rows, reverse, grid):
    """The steps in float64 from the state's codes (torch.round: half to even) and exact integer sums."""
    h, c, out = h.double(), None if c is None else c.double(), torch.zeros(gx.shape[0], H, dtype=torch.float64)
    steps = range(len(rows) - 2, -1, -1) if reverse else range(len(rows) - 1)
    for t in steps:
        first, batch = rows[t], rows[t + 1] - rows[t]
        if cell == "RNN_RELU":  # each step's own grid
            grid = recurrent.state_grid(h[:batch].float())
        q = torch.clamp(torch.round(h[:batch] * grid[1]), -128, 127)  # codes less the zero point 128
        gh = (q.long() @ codes.long().T).double() * grid[0] * scale.double() + bias.double()
        x = gx[first:first + batch].double()
        if cell.startswith("RNN"):
            h[:batch] = torch.tanh(gh + x) if cell == "RNN_TANH" else torch.relu(gh + x)
        elif cell == "LSTM":
            i, f, g_, o = (gh + x).chunk(4, 1)
            c[:batch] = torch.sigmoid(f) * c[:batch] + torch.sigmoid(i) * torch.tanh(g_)
            h[:batch] = torch.sigmoid(o) * torch.tanh(c[:batch])
        else:
            (hr, hz, hn), (xr, xz, xn) = gh.chunk(3, 1), x.chunk(3, 1)
            r, z = torch.sigmoid(hr + xr), torch.sigmoid(hz + xz)
            n = torch.tanh(xn + r * hn)
            h[:batch] = (h[:batch] - n) * z + n
        out[first:first + batch] = h[:batch]
    return out, h, c


def _run(cell, gx, weight, h0, c0, rows, reverse):
    h, c = h0.clone(), None if c0 is None else c0.clone()
    out = torch.full((gx.shape[0], 2 * H), float("nan"))[:, H:]  # a row stride of its own, as a direction's half
    grid = recurrent.state_grid(h0)
    recurrent.run_layer(cell, gx, recurrent.recurrent_weight(*weight), h, c, out, rows, reverse, grid)
    return out, h, c


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "no AVX-512", "portable", "torch"])
@pytest.mark.parametrize("cell", list(recurrent.CELLS))
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_one_step_is_exact_integer_products_and_the_cells(native_build, native_env, forbid_route, build, cell, reverse):
    # One step: the state's codes, the int8 products and the cell, no feedback, so any difference is the
    # float steps': the product's float32 roundings and the native sigmoid and tanh (a few ulp).
    if build == "torch":
        native_env(LUCID_FX_NATIVE="0")
    else:
        native_build(build)
        forbid_route(recurrent, "_cell_step")  # what follows ran native_rnn.c
    g = torch.Generator().manual_seed(1)
    weight = _weight(cell, 2)
    gx = torch.randn(4, recurrent.CELLS[cell] * H, generator=g)
    h0, c0 = torch.rand(4, H, generator=g) * 2 - 1, torch.randn(4, H, generator=g) if cell == "LSTM" else None
    rows = [0, 4]
    out, h, c = _run(cell, gx, weight, h0, c0, rows, reverse)
    want, want_h, want_c = _exact(cell, gx, *weight, h0, c0, rows, reverse, recurrent.state_grid(h0))
    torch.testing.assert_close(out.double(), want, atol=2e-6, rtol=0)
    torch.testing.assert_close(h.double(), want_h, atol=2e-6, rtol=0)
    if cell == "LSTM":
        torch.testing.assert_close(c.double(), want_c, atol=2e-6, rtol=0)


@pytest.mark.parametrize("build", ["this CPU", "torch"])
@pytest.mark.parametrize("cell", list(recurrent.CELLS))
def test_a_sequence_follows_the_exact_steps(native_build, native_env, build, cell):
    # 30 steps feed each state back: a code may round the other way where the float steps differ near a
    # tie, a difference of one step of the state's grid, which later steps damp.
    native_env(LUCID_FX_NATIVE="0") if build == "torch" else native_build(build)
    g = torch.Generator().manual_seed(3)
    weight = _weight(cell, 4, bound=weight_quant_range("cpu")[1])  # the full grid where this CPU kind has it
    if cell == "RNN_RELU":  # a gain below one: a relu state that grows past 1 (each step's grid) and stays finite
        weight = (weight[0], weight[1] * 0.1, weight[2])
    gx = torch.randn(30 * 5, recurrent.CELLS[cell] * H, generator=g)
    h0 = torch.zeros(5, H)
    c0 = torch.zeros(5, H) if cell == "LSTM" else None
    rows = [5 * t for t in range(31)]
    out, _, _ = _run(cell, gx, weight, h0, c0, rows, False)
    want, _, _ = _exact(cell, gx, *weight, h0, c0, rows, False, recurrent.state_grid(h0))
    error = (out.double() - want).abs()
    assert float(error.max()) < 1 / 127 and float(error.mean()) < 1e-4, (float(error.max()), float(error.mean()))
    assert float(out.abs().max()) > (1.5 if cell == "RNN_RELU" else 0.5)  # the states move: not a run of zeros


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_a_packed_batch_shrinks_with_time(native_on, reverse):
    # A packed sequence's steps own fewer rows as shorter sequences end: rows past a step's batch keep
    # their state (the final state of a shorter sequence; in reverse, h0 until the sequence starts).
    g = torch.Generator().manual_seed(5)
    weight = _weight("GRU", 6)
    sizes = [3, 3, 2, 1]
    rows = [0, 3, 6, 8, 9]
    gx = torch.randn(9, 3 * H, generator=g)
    h0 = torch.rand(3, H, generator=g) - 0.5
    out, h, _ = _run("GRU", gx, weight, h0, None, rows, reverse)
    want, want_h, _ = _exact("GRU", gx, *weight, h0, None, rows, reverse, recurrent.state_grid(h0))
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=0)
    torch.testing.assert_close(h.double(), want_h, atol=1e-5, rtol=0)
    if not reverse:  # sequence 2 (two steps) ended first: its final state is its step 1's, sequence 1's its step 2's
        assert torch.equal(h[2], out[rows[1] + 2]) and torch.equal(h[1], out[rows[2] + 1]) and sizes[2] == 2


def test_native_sigmoid_and_tanh_are_within_2e_7_of_torch(native_on):
    # A GRU step with a zero weight and no bias is n = tanh(gx_n), z = sigmoid(gx_z), h' = (h - n) * z + n:
    # gx_n = 0 and h = 1 give sigmoid(gx_z); gx_z = -100 (z ~ 1e-38) gives tanh(gx_n).
    v = torch.linspace(-20, 20, H * 40).reshape(40, H)
    zero = (torch.zeros(3 * H, H, dtype=torch.int8), torch.ones(3 * H), torch.zeros(3 * H))
    rows = list(range(41))
    for wanted, column, h0 in (("sigmoid", 1, torch.ones(1, H)), ("tanh", 2, torch.zeros(1, H))):
        gx = torch.zeros(40, 3 * H)
        gx[:, column * H:(column + 1) * H] = v
        if wanted == "tanh":
            gx[:, H:2 * H] = -100.0
        h = h0.clone()
        out = torch.empty(40, H)
        # one row a step, each starting again from h0 (the state is written back: reset it between steps)
        for t in range(40):
            h.copy_(h0)
            recurrent.run_layer("GRU", gx, recurrent.recurrent_weight(*zero), h, None, out, rows[t:t + 2], False, (1 / 127, 127.0))
        expected = torch.sigmoid(v.double()) if wanted == "sigmoid" else torch.tanh(v.double())
        assert float((out.double() - expected).abs().max()) < 2e-7, wanted


def test_state_grid_covers_the_initial_state():
    assert recurrent.state_grid(None) == (1 / 127, 127.0)
    scale, inv = recurrent.state_grid(torch.tensor([[0.5, -3.0]]))
    assert scale == 3.0 / 127 and inv == float(torch.tensor(127 / 3.0, dtype=torch.float32))
    assert recurrent.state_grid(torch.full((2, 3), 0.9)) == (1 / 127, 127.0)  # inside [-1, 1]: the grid of [-1, 1]
    assert recurrent.state_grid(None, 3.0) == (scale, inv)  # the bound a caller measured already


def test_a_weight_the_native_gemm_cannot_sum_exactly_takes_the_torch_route(native_build, monkeypatch):
    # Without VNNI the native GEMM sums int16 pairs, exact for |w| <= 64 only: a full-grid weight is not packed.
    native_build("no VNNI")
    codes, scale, bias = _weight("LSTM", 7, bound=127)
    assert recurrent.recurrent_weight(codes, scale, bias).packed is None
    assert recurrent.recurrent_weight(codes.clamp(-64, 64), scale, bias).packed is not None


def test_an_inputs_offsets_are_made_once_per_zero_point(native_on):
    codes, scale, bias = _weight("GRU", 8)
    weight = recurrent.recurrent_weight(codes, scale, bias)
    first = weight.offsets(131)
    assert torch.equal(first, codes.sum(1, dtype=torch.int32) * -131)
    again = recurrent.recurrent_weight(codes, scale, bias)  # built once per codes tensor: the same blocks and offsets
    assert again.packed is weight.packed and again.offsets(131) is first
    codes.add_(1)  # an in-place change (a load_state_dict) builds them again
    assert recurrent.recurrent_weight(codes, scale, bias).packed is not weight.packed


def _cell_inputs(cell: str, seed: int, batch: int, state_bound: float):
    g = torch.Generator().manual_seed(seed)
    w_ih = _weight(cell, seed + 1)[0][:, :16].contiguous(), *_weight(cell, seed + 1)[1:]  # 16 inputs
    x = torch.randn(batch, 16, generator=g) * (1 + seed % 5) + (seed % 3 - 1) * 0.7
    h = (torch.rand(batch, H, generator=g) * 2 - 1) * state_bound
    c = torch.randn(batch, H, generator=g) if cell == "LSTM" else None
    return w_ih, _weight(cell, seed + 2), x, h, c


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "no AVX-512", "portable"])
@pytest.mark.parametrize("cell", list(recurrent.CELLS))
@pytest.mark.parametrize("state_bound", [0.0, 0.9, 2.5], ids=["zeros", "inside [-1, 1]", "past 1"])
def test_a_cell_call_in_one_native_call_is_the_pieces_it_replaces(native_build, monkeypatch, build, cell, state_bound):
    # lucid_cell_float32 computes in C what dynamic_linear's pieces (per-batch qparams, quantize, GEMM) and one
    # step of run_layer (the state's grid from |h|) compute from Python: the same values, bit for bit.
    from lucid_fx.quantization.dtypes import quint8
    native_build(build)
    monkeypatch.setattr(dynamic_linear, "one_call", lambda *args: None)  # the pieces, not the linear's one C call
    for batch, seed in [(1, s) for s in range(8)] + [(3, s) for s in range(8)]:  # zero points of every rounding
        w_ih, w_hh, x, h0, c0 = _cell_inputs(cell, 10 + seed, batch, state_bound)
        weights = recurrent.recurrent_weight(*w_ih), recurrent.recurrent_weight(*w_hh)
        h, c = h0.clone(), None if c0 is None else c0.clone()
        assert recurrent.run_cell(cell, x, *weights, h, c, quint8, "cell")
        want_h, want_c = h0.clone(), None if c0 is None else c0.clone()
        largest = float(h0.abs().amax())
        recurrent.run_layer(cell, dynamic_linear.dynamic_linear(x, weights[0], quint8, "cell"), weights[1], want_h, want_c,
                            torch.empty(batch, H), [0, batch], False, recurrent.state_grid(None, largest))
        assert torch.equal(h, want_h) and (c is None or torch.equal(c, want_c))
        assert not torch.equal(h, h0)  # the step ran


@pytest.mark.parametrize("where", ["input", "h", "c"])
def test_a_cell_call_refuses_inf_or_nan_and_writes_nothing(native_on, where):
    from lucid_fx.quantization.dtypes import quint8
    w_ih, w_hh, x, h, c = _cell_inputs("LSTM", 20, 2, 0.5)
    {"input": x, "h": h, "c": c}[where][1, 3] = float("nan") if where != "c" else float("inf")
    before = h.clone(), c.clone()
    message = "the input holds inf or nan; a per-batch range" if where == "input" else "the initial state holds inf or nan"
    with pytest.raises(ValueError, match=f"^DynamicQuantizedLSTMCell: {message}"):
        recurrent.run_cell("LSTM", x, recurrent.recurrent_weight(*w_ih), recurrent.recurrent_weight(*w_hh), h, c, quint8,
                           "DynamicQuantizedLSTMCell")
    for got, was in zip((h, c), before):  # unchanged (NaN where it was put)
        torch.testing.assert_close(got, was, rtol=0, atol=0, equal_nan=True)


def test_a_cell_call_the_native_cell_does_not_take_returns_false(native_on):
    # an int8 activation grid (torch's route quantizes those), or no native kernels: the caller runs the pieces
    from lucid_fx.quantization.dtypes import qint8, quint8
    w_ih, w_hh, x, h, c = _cell_inputs("GRU", 30, 2, 0.5)
    weights = recurrent.recurrent_weight(*w_ih), recurrent.recurrent_weight(*w_hh)
    before = h.clone()
    assert not recurrent.run_cell("GRU", x, *weights, h, None, qint8, "cell") and torch.equal(h, before)
    assert recurrent.run_cell("GRU", x, *weights, h, None, quint8, "cell") and not torch.equal(h, before)


def _tight(t):
    bound = float(t.abs().amax()) or 1.0
    return bound / 127, float(torch.tensor(127 / bound, dtype=torch.float32))


@pytest.mark.parametrize("build", ["this CPU", "no VNNI", "portable", "torch"])
def test_a_projected_lstm_follows_the_exact_steps(native_build, native_env, build):
    # proj_size P: the state h (P) on each step's tight grid, times W_hh; the cell's o * tanh(c) (H) on its own
    # tight grid, times W_hr (P x H), is the next h. Exact integer products and float64 cells for reference.
    native_env(LUCID_FX_NATIVE="0") if build == "torch" else native_build(build)
    g = torch.Generator().manual_seed(7)
    P, steps, batch = 10, 12, 3
    w_hh = torch.randint(-63, 64, (4 * H, P), generator=g, dtype=torch.int8), torch.rand(4 * H, generator=g) * 0.03 + 0.01, \
        torch.randn(4 * H, generator=g) * 0.3
    w_hr = torch.randint(-63, 64, (P, H), generator=g, dtype=torch.int8), torch.rand(P, generator=g) * 0.004 + 0.002
    gx = torch.randn(steps * batch, 4 * H, generator=g)
    h0, c0 = torch.rand(batch, P, generator=g) - 0.5, torch.randn(batch, H, generator=g)
    rows = [batch * t for t in range(steps + 1)]
    h, c, out = h0.clone(), c0.clone(), torch.full((steps * batch, P), float("nan"))
    recurrent.run_layer("LSTM", gx, recurrent.recurrent_weight(*w_hh), h, c, out, rows, False, recurrent.state_grid(h0),
                        recurrent.recurrent_weight(*w_hr, None))
    want_h, want_c, want = h0.double(), c0.double(), torch.zeros(steps * batch, P, dtype=torch.float64)
    for t in range(steps):
        scale, inv = _tight(want_h.float())
        q = torch.clamp(torch.round(want_h * inv), -128, 127)
        gates = (q.long() @ w_hh[0].long().T).double() * scale * w_hh[1].double() + w_hh[2].double() + gx[t * batch:(t + 1) * batch].double()
        i, f, g_, o = gates.chunk(4, 1)
        want_c = torch.sigmoid(f) * want_c + torch.sigmoid(i) * torch.tanh(g_)
        full = torch.sigmoid(o) * torch.tanh(want_c)
        f_scale, f_inv = _tight(full.float())
        fq = torch.clamp(torch.round(full * f_inv), -128, 127)
        want_h = (fq.long() @ w_hr[0].long().T).double() * f_scale * w_hr[1].double()
        want[t * batch:(t + 1) * batch] = want_h
    error = (out.double() - want).abs()
    # measured 1e-7 at most; a code that rounds the other way at a tie would move h by ~2e-3
    assert float(error.max()) < 2e-3 and float(error.mean()) < 1e-5, (float(error.max()), float(error.mean()))
    torch.testing.assert_close(c.double(), want_c, atol=2e-3, rtol=0)
    assert float(out.abs().max()) > 0.05 and torch.equal(h, out[-batch:])
